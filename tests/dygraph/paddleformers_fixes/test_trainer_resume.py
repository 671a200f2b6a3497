"""What the Trainer resumes from (``paddleformers_fixes.trainer_resume``), without processes or
PaddleFormers: the completeness of a checkpoint folder and the resolution of
``resume_from_checkpoint`` on a first start and in a restart."""
import os

import pytest

from paddle_hybrid.dygraph.paddleformers_fixes.trainer_resume import (COMPLETE, SAVING, is_complete,
                                                                      newest_complete, resolve)


def _checkpoint(root, step, markers=()):
    folder = root / f"checkpoint-{step}"
    folder.mkdir()
    for marker in markers:
        (folder / marker).write_text("")
    return str(folder)


@pytest.fixture
def output_dir(tmp_path):
    _checkpoint(tmp_path, 2)                      # written without the plugin: complete
    _checkpoint(tmp_path, 4, [COMPLETE])          # complete
    _checkpoint(tmp_path, 10, [SAVING])           # cut by a death (10 > 4: sorted by number, not name)
    (tmp_path / "checkpoint-x").mkdir()           # not a checkpoint
    return tmp_path


def test_a_folder_marked_as_being_saved_is_incomplete(output_dir):
    assert is_complete(str(output_dir / "checkpoint-2")) and is_complete(str(output_dir / "checkpoint-4"))
    assert not is_complete(str(output_dir / "checkpoint-10"))


def test_the_newest_complete_checkpoint_skips_a_cut_one_and_says_so(output_dir):
    said = []
    assert newest_complete(str(output_dir), said.append) == str(output_dir / "checkpoint-4")
    assert said == [f"skipping {output_dir / 'checkpoint-10'}: incomplete (a rank stopped while it was being saved)"]
    assert newest_complete(str(output_dir / "missing"), said.append) is None


@pytest.mark.parametrize("value", [True, "True", "true", "yes", "1"])
def test_true_means_the_newest_complete_checkpoint(output_dir, value):
    assert resolve(value, str(output_dir), 0, say=lambda m: None) == str(output_dir / "checkpoint-4")


@pytest.mark.parametrize("value", [True, "True"])
def test_true_with_nothing_saved_starts_fresh(tmp_path, value):
    said = []
    assert resolve(value, str(tmp_path), 0, say=said.append) is None
    assert "no complete checkpoint" in said[-1] and "training from the start" in said[-1]


@pytest.mark.parametrize("value", [None, False, "False", "false", "none", ""])
def test_nothing_on_a_first_start_is_a_fresh_start(output_dir, value):
    assert resolve(value, str(output_dir), 0, say=lambda m: None) is None


@pytest.mark.parametrize("value", [None, False, "False"])
def test_nothing_in_a_restart_is_the_newest_complete_checkpoint(output_dir, value):
    said = []
    assert resolve(value, str(output_dir), 1, say=said.append) == str(output_dir / "checkpoint-4")
    assert said[-1] == f"restart 1: resuming from {output_dir / 'checkpoint-4'}"


def test_a_path_is_kept_and_a_cut_one_refused(output_dir):
    path = str(output_dir / "checkpoint-2")
    assert resolve(path, str(output_dir), 1, say=lambda m: None) == path  # the user's choice wins in a restart
    with pytest.raises(ValueError, match="checkpoint-10.*incomplete"):
        resolve(str(output_dir / "checkpoint-10"), str(output_dir), 0)
