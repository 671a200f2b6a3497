"""PaddleFormers' ``distributed_isfile`` / ``distributed_file`` in a dry run's fake world
(:mod:`paddle_hybrid.dygraph.paddleformers_fixes.fake_world_files`): each rank answers from the disk, as the
one-process path does; outside a fake world PaddleFormers' own (an exchange between ranks).  The dry run of a
resumed Trainer that needs it: ``tests/dryrun/test_pretrained_checkpoint.py``."""
from paddle_hybrid.dygraph.paddleformers_fixes import fake_world_files


def _stock(calls):
    def stock(filename):
        calls.append(filename)
        return "stock"

    return stock


def test_in_a_fake_world_each_rank_looks_at_the_disk(tmp_path):
    (tmp_path / "scheduler.pdparams").write_bytes(b"s")
    (tmp_path / "trainer_state.bin").write_bytes(b"t")
    calls = []
    isfile = fake_world_files._make_isfile(_stock(calls), lambda: True)
    found = fake_world_files._make_file(_stock(calls), lambda: True)
    assert isfile(str(tmp_path / "scheduler.pdparams")) is True
    assert isfile(str(tmp_path / "scaler.pdparams")) is False
    # a trainer state is read as .json or .bin, whichever is there (.json first)
    assert isfile(str(tmp_path / "trainer_state.json")) is True
    assert found(str(tmp_path / "trainer_state.json")) == str(tmp_path / "trainer_state.bin")
    (tmp_path / "trainer_state.json").write_text("{}")
    assert found(str(tmp_path / "trainer_state.bin")) == str(tmp_path / "trainer_state.json")
    assert found(str(tmp_path / "scheduler.pdparams")) == str(tmp_path / "scheduler.pdparams")
    assert calls == []


def test_outside_a_fake_world_paddleformers_answers():
    calls = []
    assert fake_world_files._make_isfile(_stock(calls), lambda: False)("a.pdparams") == "stock"
    assert fake_world_files._make_file(_stock(calls), lambda: False)("b.json") == "stock"
    assert calls == ["a.pdparams", "b.json"]


def test_nothing_is_replaced_outside_a_fake_world():
    class Recorder:
        def set(self, *args):
            raise AssertionError("replaced outside a fake world")

    fake_world_files.fix(Recorder(), None)
