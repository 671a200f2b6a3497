"""``python -m paddle_hybrid.verify`` with the layouts of virtual stages, group-sharded stages 2 and
3, segment and expert parallel: equal to one process for the examples, and defects that train
silently wrong only at degree 4 (``hybrid_script.py --defect``) named there while the same script
is equal at degree 2, and equal at degree 4 without them.

Several layouts share one command (and its one-process run).  Before this test's layouts existed
the verifier refused them ("write degrees joined"); the defects' findings were seen failing by
removing each piece of the verifier that names them (docs/verify.md lists which)."""
import os

from test_verify import GPT, HERE, ROOT, verify

MOE = os.path.join(ROOT, "examples", "moe_ep.py")
HYBRID = os.path.join(HERE, "hybrid_script.py")
# 8 blocks: 4 stages x 2 virtual stages of one block; 4 microbatches: the interleaved schedule's multiple of 4
GPT_ARGS = ["--steps", "2", "--layers", "8", "--hidden", "32", "--heads", "4", "--seq-len", "16",
            "--micro-batch-size", "4", "--accumulate-steps", "4", "--corpus-chars", "20000"]


def _all_equal(code, text, verdict, layouts):
    assert code == 0, text
    assert sorted(verdict["layouts"]) == sorted(layouts), verdict
    for name, layout in verdict["layouts"].items():
        assert layout["equal"] and not layout["findings"], (name, layout)
        assert layout["grads_compared"] == verdict["layouts"][layouts[0]]["grads_compared"] > 0, (name, layout)


def test_gpt_pp_in_the_new_layouts_is_equal(tmp_path):
    """Virtual stages (4 stages x 2 chunks), group-sharded stages 2 and 3 (stage 3 slices every
    matrix: ``--segment-size`` 1024), segment parallel (each rank half of every sequence): losses,
    every parameter's step-1 gradient (a stage-3 slice joined with the other rank's) and the
    parameters, against one process."""
    layouts = ["pp4vp2", "sharding2s2", "sharding2s3", "sep2"]
    _all_equal(*verify(tmp_path, ",".join(layouts), GPT, *GPT_ARGS), layouts)


def test_moe_ep_with_expert_parallel_is_equal(tmp_path):
    """Expert parallel over 2 and 4 ranks (also the data-parallel replicas): each expert's
    parameters, held by one rank as its local expert 0 or 1, compared under the whole model's
    number with one process's."""
    code, text, verdict = verify(tmp_path, "ep2,ep4", MOE, "--steps", "2")
    _all_equal(code, text, verdict, ["ep2", "ep4"])
    # every parameter: the embedding, the head's 2, the gate's 2 and 4 experts' 4
    assert verdict["layouts"]["ep4"]["grads_compared"] == 21, verdict


DEFECTS = ["--defect", "head_split", "--defect", "chunk_order", "--defect", "tie_neighbours",
           "--defect", "partition_remainder"]


def test_defects_that_show_only_at_degree_4_are_named(tmp_path):
    """Every planted defect on at once: each degree-2 layout is equal (the defect's code path is
    not taken, or does no harm there), each degree-4 layout differs from step 1 and says what it
    saw."""
    code, text, verdict = verify(tmp_path, "tp2,tp4,pp2vp2,pp4vp2,sharding2s2,sharding4s2", HYBRID, *DEFECTS)
    assert code == 1, text
    layouts = verdict["layouts"]
    for name in ("tp2", "pp2vp2", "sharding2s2"):
        assert layouts[name]["equal"], (name, layouts[name])
    for name in ("tp4", "pp4vp2", "sharding4s2"):
        assert not layouts[name]["equal"] and layouts[name]["first_step"] == 1, (name, layouts[name])
    # one head a rank read as q, v, k: every attention's gradient is off
    assert layouts["tp4"]["grad_diff"] > 0.1 and any(n.endswith("qkv.weight") for n, _ in
                                                     layouts["tp4"]["diverging"]["grads"]), layouts["tp4"]
    findings = layouts["pp4vp2"]["findings"]
    # the chunk order: the layers of chunk 1 (blocks 4-7, named 5-8) start from other weights
    assert any(f.startswith("the layout starts from another model: 8 parameters differ before the first update")
               for f in findings), findings
    assert ("the parameters that differ are all in virtual chunk 1 of pipeline stages 0, 1, 2, 3 (layers 5, 6, 7, 8); "
            "every parameter of chunk 0 agrees") in "\n".join(findings), findings
    # the tie between stage 0 and stage 3, not neighbours
    assert any(f.startswith("shared_layers.embed.weight: differs within the pipeline-tied group [0, 3] after step 1")
               for f in findings), findings
    findings = layouts["sharding4s2"]["findings"]
    dropped = [f for f in findings if "in no partition of the sharding group [0, 1, 2, 3]" in f]
    assert len(dropped) == 2, findings  # 34 parameters, 8 a rank: the last 2 in none
    assert "in no partition of the sharding group" in text and "tp4          DIFFERS" in text, text


def test_the_degree_4_layouts_are_equal_without_the_defects(tmp_path):
    layouts = ["tp4", "pp4vp2", "sharding4s2"]
    _all_equal(*verify(tmp_path, ",".join(layouts), HYBRID), layouts)
