"""The decision of :mod:`paddle_hybrid.cpu_blas` for every case, with the machine's facts
faked: vendor AMD / Intel / other / unknown, AVX2 or not, MKL old / new / unreadable, the
variable set before."""
import pytest

from paddle_hybrid.cpu_blas.decision import VALUE, Facts, decide

OLD = (2019, 0, 5)
AMD = dict(vendor="AuthenticAMD", vendor_note="/proc/cpuinfo", avx2_fma=True, mkl_version=OLD, mkl_note="lib")


def test_amd_with_old_mkl_sets_the_avx2_type():
    d = decide(Facts(**AMD))
    assert d.set_value == VALUE == "5"
    assert "AMD" in d.reason and "2019.0 Update 5" in d.reason


@pytest.mark.parametrize("version, sets", [((2020, 0, 0), True), ((2020, 0, 1), False), ((2021, 1, 0), False),
                                           ((2018, 0, 3), True)])
def test_only_mkl_up_to_2020_0_honours_it(version, sets):
    d = decide(Facts(**{**AMD, "mkl_version": version}))
    assert (d.set_value == VALUE) is sets, d.reason
    if not sets:
        assert "ignores" in d.reason


def test_unreadable_mkl_version_sets_nothing():
    d = decide(Facts(**{**AMD, "mkl_version": None, "mkl_note": "this Paddle has no libmklml_intel.so"}))
    assert d.set_value is None
    assert "unknown" in d.reason and "no libmklml_intel.so" in d.reason


def test_intel_sets_nothing():
    d = decide(Facts(**{**AMD, "vendor": "GenuineIntel"}))
    assert d.set_value is None and d.reason.startswith("Intel CPU")


def test_unknown_vendor_sets_nothing_and_says_why():
    d = decide(Facts(vendor=None, vendor_note="no /proc/cpuinfo on this OS"))
    assert d.set_value is None and "unknown" in d.reason and "no /proc/cpuinfo" in d.reason


def test_other_vendor_sets_nothing():
    d = decide(Facts(**{**AMD, "vendor": "CentaurHauls"}))
    assert d.set_value is None and "not AMD" in d.reason


def test_amd_without_avx2_sets_nothing():
    d = decide(Facts(**{**AMD, "avx2_fma": False}))
    assert d.set_value is None and "AVX2" in d.reason


@pytest.mark.parametrize("preset", ["5", "2", ""])
def test_a_value_set_before_is_left_alone(preset):
    d = decide(Facts(**{**AMD, "preset": preset}))
    assert d.set_value is None and "left as it is" in d.reason


# MKL's second code path (paddle_hybrid.cpu_blas.paths), with the machine's facts faked

from paddle_hybrid.cpu_blas.decision import Decision  # noqa: E402
from paddle_hybrid.cpu_blas.paths import alternate_path, describe_cpu_type, shell_lines  # noqa: E402

NOTHING = Decision(None, "Intel CPU")
AVX2_SET = Decision(VALUE, "AMD CPU with AVX2/FMA")


def test_avx512_intel_runs_the_avx2_kernels_second():
    path = alternate_path("GenuineIntel", frozenset({"avx2", "fma", "avx512f"}), NOTHING)
    assert path.environment == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert "AVX2" in path.label and "AVX-512" in path.label
    assert shell_lines(path) == "export MKL_ENABLE_INSTRUCTIONS=AVX2\n"


def test_avx2_intel_runs_the_avx_kernels_second():
    path = alternate_path("GenuineIntel", frozenset({"avx2", "fma"}), NOTHING)
    assert path.environment == {"MKL_ENABLE_INSTRUCTIONS": "AVX"}


def test_amd_with_the_plugins_avx2_runs_the_generic_kernels_second():
    """The plugin's own setting is switched off for the workers and the variable unset, so no
    process of the run takes the AVX2 path again."""
    path = alternate_path("AuthenticAMD", frozenset({"avx2", "fma"}), AVX2_SET)
    assert path.environment == {"PADDLE_HYBRID_CPU_BLAS": "0", "MKL_DEBUG_CPU_TYPE": None}
    assert shell_lines(path) == "unset MKL_DEBUG_CPU_TYPE\nexport PADDLE_HYBRID_CPU_BLAS=0\n"
    assert "generic" in path.label


@pytest.mark.parametrize("vendor, flags, decision", [
    ("AuthenticAMD", frozenset({"avx2", "fma"}), NOTHING),  # a newer MKL, or the user's own value
    ("GenuineIntel", frozenset({"sse4_2"}), NOTHING),
    (None, frozenset(), NOTHING),
    ("HygonGenuine", frozenset({"avx2"}), NOTHING),
])
def test_no_second_path_where_none_is_known(vendor, flags, decision):
    assert alternate_path(vendor, flags, decision) is None


def test_cpu_types_are_named():
    assert describe_cpu_type(7) == "CPU type 7 (AVX-512)"
    assert describe_cpu_type(5) == "CPU type 5 (AVX2)"
    assert describe_cpu_type(2) == "CPU type 2 (generic or other)"
    assert "unknown" in describe_cpu_type(None)
