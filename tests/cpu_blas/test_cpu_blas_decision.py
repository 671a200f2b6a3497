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
