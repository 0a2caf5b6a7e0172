"""The images registry: the canary's decision as a specification, the append-only history and the pointer."""

from __future__ import annotations

import json
import random
import shutil
import threading
from collections import Counter

import pytest
from pydantic import TypeAdapter, ValidationError

from tests.conftest import tuneproof
from tuneproof.control import images
from tuneproof.control.images import CandidateImage, Decision, decide
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.storage import Storage

DLC = "public.ecr.aws/deep-learning-containers/ray"
OLD = f"{DLC}:train-ml-cuda-v1.1@sha256:" + "a" * 64
NEW = f"{DLC}:train-ml-cuda-v1.2@sha256:" + "b" * 64


def decision(decision_id: str, image: str, verdict: str = "adopt", **metrics: list[float]) -> Decision:
    return Decision(
        decision_id=decision_id,
        candidate_image=image,
        digest=images.digest_of(image),
        release_tag=images.release_tag(image),
        profile="eks",
        candidate_metrics={k.replace("__", "."): v for k, v in metrics.items()},
        threshold=0.1,
        decision=verdict,
        reasons=["test"],
        decided_at="2026-12-01T14:00:00Z",
    )


# ---- the candidate image type ------------------------------------------------------------------


def test_candidate_image_must_be_pinned_by_a_full_digest():
    adapter = TypeAdapter(CandidateImage)
    assert adapter.validate_python(NEW) == NEW
    assert adapter.validate_python("localhost:5000/ray@sha256:" + "0" * 64)
    for bad, says in (
        (f"{DLC}:train-ml-cuda-v1.2", "not pinned by digest"),
        (f"{DLC}@sha256:" + "b" * 63, "64 lowercase hex"),
        (f"{DLC}@sha256:" + "B" * 64, "64 lowercase hex"),
    ):
        with pytest.raises(ValidationError, match=says) as caught:
            adapter.validate_python(bad)
        assert repr(bad) in str(caught.value)  # the error names the value
    assert adapter.json_schema()["pattern"] == images.IMAGE_PATTERN  # the Prefect form checks it too


def test_tags_digests_and_the_local_environment_as_an_image():
    assert images.release_tag(NEW) == "train-ml-cuda-v1.2"
    assert images.release_tag("localhost:5000/ray@sha256:" + "0" * 64) is None  # a port is not a tag
    assert images.digest_of(NEW) == "sha256:" + "b" * 64
    local = images.local_image()
    assert local.startswith("local-env@sha256:") and images.image_problem(local) is None
    assert images.local_image() == local  # the same environment, the same "image"


# ---- the decision (pure) -------------------------------------------------------------------------


def test_a_failed_canary_is_rejected_with_its_cause():
    verdict, reasons, compared = decide("finetune: modeling: loss is NaN at step 3", None, {}, 0.1)
    assert verdict == "reject" and compared == []
    assert reasons == ["the canary failed: finetune: modeling: loss is NaN at step 3"]


def test_the_first_canary_becomes_the_baseline_and_says_so():
    verdict, reasons, _ = decide(None, None, {"finetune.tokens_per_s": [1000.0]}, 0.1)
    assert verdict == "adopt"
    assert reasons == ["no current image: this canary's measurements become the baseline"]


def test_one_run_on_either_side_is_never_a_verdict():
    """A single value a side is one draw of the noise: not adopted, however close or far the values are."""
    base = decision("d1", OLD, finetune__tokens_per_s=[1000.0], finetune__final_loss=[0.50])
    same = {"finetune.tokens_per_s": [1000.0, 1001.0, 999.0], "finetune.final_loss": [0.50, 0.50, 0.50]}
    verdict, reasons, compared = decide(None, base, same, 0.1)
    assert verdict == "reject" and {m.verdict for m in compared} == {"insufficient repeats"}
    assert reasons[0] == (
        "not adopted: insufficient repeats for finetune.final_loss to tell a 10% change from noise (ratio 1.000; "
        "need 2 repeats a side at the spread seen)"
    )
    far = decide(None, decision("d1", OLD, finetune__tokens_per_s=[1000.0]), {"finetune.tokens_per_s": [300.0]}, 0.1)
    assert far[0] == "reject" and far[2][0].verdict == "insufficient repeats"  # not "worse": nothing to judge by
    assert far[1] == [
        "not adopted: insufficient repeats for finetune.tokens_per_s to tell a 10% change from noise (ratio 0.300; "
        "the baseline has one value: need 2 or more repeats a side for any interval)"
    ]


def test_repeats_on_both_sides_use_the_t_interval_and_unresolved_is_not_adopted():
    base = decision("d1", OLD, finetune__tokens_per_s=[1000.0, 1010.0, 990.0])
    noisy = {"finetune.tokens_per_s": [700.0, 1300.0, 1000.0]}
    verdict, reasons, compared = decide(None, base, noisy, 0.1)
    assert verdict == "reject" and compared[0].ci95 is not None
    assert compared[0].verdict == "insufficient repeats"  # three noisy repeats cannot say worse, nor equal
    assert reasons == [
        "not adopted: insufficient repeats for finetune.tokens_per_s to tell a 10% change from noise (ratio 0.969, "
        f"95% CI {compared[0].ci95[0]:.3f}..{compared[0].ci95[1]:.3f}; need {compared[0].repeats_needed} repeats a "
        "side at the spread seen)"
    ]
    slower = {"finetune.tokens_per_s": [700.0, 710.0, 690.0]}
    verdict, reasons, compared = decide(None, base, slower, 0.1)
    assert verdict == "reject" and reasons[0].startswith("finetune.tokens_per_s: worse (higher is better)")
    assert "95% CI" in reasons[0]
    same = {"finetune.tokens_per_s": [1001.0, 1009.0, 992.0]}
    verdict, reasons, _ = decide(None, base, same, 0.1)
    assert verdict == "adopt" and reasons == [f"no metric worse than d1 ({OLD}) beyond 10%: 1 compared, 0 better"]


def test_a_metric_fallen_to_zero_is_never_adopted():
    """Exact match 0 on the candidate has no logarithm and so no interval: refused, never 'no finding'."""
    base = decision("d1", OLD, eval__candidate__exact_match=[0.99, 0.99, 1.0], finetune__tokens_per_s=[1000.0] * 3)
    broken = {"eval.candidate.exact_match": [0.0, 0.0, 0.0], "finetune.tokens_per_s": [1001.0, 999.0, 1000.0]}
    verdict, reasons, compared = decide(None, base, broken, 0.1)
    assert (
        verdict == "reject" and {m.name: m.verdict for m in compared}["eval.candidate.exact_match"] == "not enough data"
    )
    assert reasons == [
        "not adopted: eval.candidate.exact_match cannot be compared on a ratio scale (baseline [0.99, 0.99, 1], "
        "candidate [0, 0, 0]: a value <= 0 has no logarithm)"
    ]


METRICS = (
    "finetune.tokens_per_s",
    "finetune.final_loss",
    "finetune.step_seconds",
    "connectivity.busbw_GBps@1048576B",
    "connectivity.busbw_GBps@4194304B",
    "eval.candidate.exact_match",
)


def simulated_canaries(noise: float, repeats: int, worse_by: float = 0.0, seed: int = 5) -> tuple[Counter, int]:
    """1,000 canary decisions over METRICS, baseline and candidate drawn alike (lognormal noise); with
    `worse_by`, the candidate's tokens/s is that much lower. (decisions by verdict, decisions finding any
    metric worse)."""
    rng = random.Random(seed)
    decisions, found_worse = Counter[str](), 0

    def arm(shift: float = 0.0) -> dict[str, list[float]]:
        drawn = {m: [rng.lognormvariate(0, noise) * 10 for _ in range(repeats)] for m in METRICS}
        drawn["finetune.tokens_per_s"] = [v * (1 - shift) for v in drawn["finetune.tokens_per_s"]]
        return drawn

    for _ in range(1000):
        baseline = decision("d1", OLD).model_copy(update={"candidate_metrics": arm()})
        verdict, _, compared = decide(None, baseline, arm(worse_by), 0.1)
        decisions[verdict] += 1
        found_worse += any(m.verdict == "worse" for m in compared)
    return decisions, found_worse


def test_a_and_a_canaries_adopt_and_are_never_called_worse_beyond_5_percent():
    """The same image against itself, six metrics at once: each interval at 1 - 0.05/6 (Bonferroni)."""
    decisions, worse = simulated_canaries(noise=0.02, repeats=5)  # a spread 5 repeats resolve at 10 %
    assert decisions["adopt"] >= 950 and worse <= 50, (decisions, worse)
    for noise in (0.05, 0.1, 0.3):  # too noisy for 3 repeats: not adopted, and still not called worse
        decisions, worse = simulated_canaries(noise=noise, repeats=3)
        assert decisions["adopt"] <= 50 and worse <= 50, (noise, decisions, worse)


def test_a_real_regression_of_one_metric_among_six_is_found():
    decisions, worse = simulated_canaries(noise=0.02, repeats=5, worse_by=0.3)
    assert decisions["reject"] >= 950 and worse >= 950, (decisions, worse)


def test_a_metric_the_candidate_no_longer_reports_rejects():
    # ignore: a metric name no keyword can spell, so a dict (mypy cannot tell it never fills `verdict`).
    base = decision("d1", OLD, **{"connectivity__busbw_GBps@1048576B": [2.0]})  # type: ignore[arg-type]
    verdict, reasons, _ = decide(None, base, {}, 0.1)
    assert verdict == "reject"
    assert reasons == ["connectivity.busbw_GBps@1048576B: measured on the baseline, not by the candidate"]


NOTHING_COMPARED = f"not adopted: nothing compared with 20261201-140000-aaaaaa ({OLD}): "
NO_EVIDENCE = "; 0 comparisons is no evidence that the image is no worse"
NOT_ON_BASELINE = "the baseline has no values of finetune.final_loss, which the candidate measured"


@pytest.mark.parametrize(
    ("stored", "measured", "why"),
    [
        ({}, {"finetune.final_loss": [9.0, 9.1, 9.2]}, NOT_ON_BASELINE),
        ({"finetune.final_loss": []}, {"finetune.final_loss": [9.0]}, NOT_ON_BASELINE),
        ({}, {}, "neither the baseline nor the candidate has values of a metric with a better side"),
    ],
    ids=["no metrics", "no values", "nothing either side"],
)
def test_a_stored_baseline_with_nothing_to_compare_never_adopts(tmp_path, stored, measured, why):
    """A damaged or hand-edited baseline decision.json with no values adopted any candidate: '0 compared'."""
    storage = Storage(str(tmp_path))
    baseline = decision("20261201-140000-aaaaaa", OLD).model_copy(update={"candidate_metrics": stored})
    images.create_decision(storage, baseline)
    verdict, reasons, compared = decide(None, images.load_decision(storage, baseline.decision_id), measured, 0.1)
    assert verdict == "reject" and compared == []
    assert reasons == [NOTHING_COMPARED + why + NO_EVIDENCE]


def test_a_metric_only_the_candidate_measured_is_named_not_skipped():
    base = decision("d1", OLD, finetune__tokens_per_s=[1000.0, 1010.0, 990.0])
    more = {"finetune.tokens_per_s": [1001.0, 1009.0, 992.0], "eval.candidate.exact_match": [0.9, 0.91, 0.9]}
    verdict, reasons, compared = decide(None, base, more, 0.1)
    assert verdict == "adopt" and [m.name for m in compared] == ["finetune.tokens_per_s"]
    assert reasons == [
        f"no metric worse than d1 ({OLD}) beyond 10%: 1 compared, 0 better",
        "eval.candidate.exact_match: measured by the candidate, not on the baseline: not compared",
    ]


def test_a_canary_needs_two_runs_or_more():
    assert images.repeats_problem(3) is None and images.repeats_problem(20) is None
    assert images.repeats_problem(1) == (
        "repeats must be at least 2 (got 1): one run gives one value per metric, and one value cannot tell a change "
        "from noise (3 by default)"
    )
    assert images.repeats_problem(21) == "repeats must be between 2 and 20 (got 21)"


# ---- storage: append-only history, compare-and-swap pointer ---------------------------------------


def test_history_is_append_only_and_the_pointer_moves_only_on_adopt(tmp_path):
    storage = Storage(str(tmp_path))
    first = decision("20261201-140000-aaaaaa", OLD, finetune__tokens_per_s=[1000.0])
    assert images.create_decision(storage, first)
    assert not images.create_decision(storage, first.model_copy(update={"decision": "reject"}))  # never rewritten
    assert images.load_decision(storage, first.decision_id).decision == "adopt"
    assert images.read_current(storage) == (None, None)
    pointer = images.adopt(storage, first, None, "2026-12-01T14:05:00Z")
    current, token = images.read_current(storage)
    assert current == pointer and current.image == OLD and current.previous_decision is None

    rejected = decision("20261201-150000-bbbbbb", NEW, "reject")
    assert images.create_decision(storage, rejected)
    decisions, problems = images.history(storage)
    assert [d.decision_id for d in decisions] == [rejected.decision_id, first.decision_id] and problems == []
    rows = [images.row(d, current) for d in decisions]
    assert [(r["decision"], r["current"]) for r in rows] == [("reject", False), ("adopt", True)]
    assert rows[1]["candidate_metrics"] == {"finetune.tokens_per_s": 1000.0}
    assert images.read_current(storage)[1] == token  # a rejection never touches the pointer


def test_a_pointer_that_moved_meanwhile_is_a_conflict_and_stays_whole(tmp_path):
    storage = Storage(str(tmp_path))
    base = decision("20261201-140000-aaaaaa", OLD)
    images.adopt(storage, base, None, "t0")
    _, token = images.read_current(storage)
    a = decision("20261201-150000-cccccc", NEW).model_copy(update={"baseline_decision": base.decision_id})
    b = decision("20261201-150001-dddddd", NEW).model_copy(update={"baseline_decision": base.decision_id})
    results: dict[str, object] = {}

    def try_adopt(d: Decision) -> None:
        try:
            results[d.decision_id] = images.adopt(storage, d, token, "t1")
        except images.ImageConflict as e:
            results[d.decision_id] = e

    threads = [threading.Thread(target=try_adopt, args=(d,)) for d in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conflicts = [r for r in results.values() if isinstance(r, images.ImageConflict)]
    assert len(conflicts) == 1 and "moved while the canary ran" in str(conflicts[0])
    current, _ = images.read_current(storage)
    assert current is not None and current.previous_decision == base.decision_id
    assert current.decision_id in (a.decision_id, b.decision_id)
    # a retry of the winner (its first response lost) is success, not a conflict
    winner = a if current.decision_id == a.decision_id else b
    assert images.adopt(storage, winner, token, "t2").decision_id == winner.decision_id


def test_bad_ids_and_corrupt_files_are_named(tmp_path):
    storage = Storage(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="decisions: none: run `tuneproof canary` first"):
        images.load_decision(storage, "20261201-000000-000000")
    with pytest.raises(FileNotFoundError, match=r"decision id '\.\./x'"):
        images.load_decision(storage, "../x")
    storage.write_bytes(b"{not json", "images", "current.json")
    with pytest.raises(images.ImagesUnreadable, match="current.json: not a current-image pointer"):
        images.read_current(storage)
    storage.write_bytes(b'{"decision_id": 3}', "images", "20261201-000000-eeeeee", "decision.json")
    decisions, problems = images.history(storage)
    assert decisions == [] and "20261201-000000-eeeeee/decision.json: not an image decision" in problems[0]


def test_a_copied_decision_folder_is_refused_by_name_in_images_list(tmp_path):
    """A folder copied under another id held the original's decision: listed twice, and neither was current."""
    storage = Storage(str(tmp_path))
    first = decision("20261201-140000-aaaaaa", OLD, finetune__tokens_per_s=[1000.0] * 3)
    images.create_decision(storage, first)
    shutil.copytree(tmp_path / "images" / first.decision_id, tmp_path / "images" / "20261202-140000-bbbbbb")
    images.adopt(storage, first.model_copy(update={"decision_id": "20261202-140000-bbbbbb"}), None, "t")
    listed = tuneproof("images", "list", "--json", "--set", f"storage.root={tmp_path}")
    assert listed.exit_code == 0
    assert [(r["decision_id"], r["current"]) for r in json.loads(listed.stdout)] == [(first.decision_id, False)]
    said = " ".join(listed.stderr.split())
    assert "images/20261202-140000-bbbbbb/decision.json: the decision '20261201-140000-aaaaaa', not " in said
    assert "'20261202-140000-bbbbbb' (a copied decision folder?)" in said
    with pytest.raises(images.ImagesUnreadable, match="a copied decision folder"):  # the canary's baseline read
        images.load_decision(storage, "20261202-140000-bbbbbb")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold", float("nan")),
        ("candidate_metrics", {"finetune.final_loss": [float("inf"), 1.0, 1.0]}),
        ("baseline_metrics", {"finetune.final_loss": [float("-inf")]}),
    ],
)
def test_a_stored_decision_with_non_finite_values_is_refused_when_read(tmp_path, field, value):
    """NaN or Infinity in a decision.json reached the canary's statistics after all its runs: math domain error."""
    storage = Storage(str(tmp_path))
    doc = {**decision("20261201-140000-aaaaaa", OLD, finetune__final_loss=[1.0] * 3).to_json(), field: value}
    storage.write_bytes(json.dumps(doc).encode(), "images", "20261201-140000-aaaaaa", "decision.json")
    listed = tuneproof("images", "list", "--json", "--set", f"storage.root={tmp_path}")
    assert listed.exit_code == 0 and json.loads(listed.stdout) == []
    said = " ".join(listed.stderr.split())
    assert "20261201-140000-aaaaaa/decision.json: not an image decision" in said and "finite number" in said
    assert "no image decisions under" not in said  # there is one: it is refused, by name
    with pytest.raises(images.ImagesUnreadable, match="finite number"):
        images.load_decision(storage, "20261201-140000-aaaaaa")


def test_non_finite_measurements_are_left_out_of_a_decision():
    """A NaN eval loss or an overflowed perplexity measured nothing; kept, the decision could not be stored."""
    measured = images.metric_values(
        [
            {"eval.candidate.perplexity": float("inf"), "eval.candidate.eval_loss": 2.0},
            {"eval.candidate.eval_loss": float("nan")},
        ]
    )
    assert measured == {"eval.candidate.perplexity": [], "eval.candidate.eval_loss": [2.0]}


# ---- EKS runs take their image from the pointer --------------------------------------------------


def test_eks_runs_on_the_standing_cluster_take_the_adopted_image():
    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    pointer = images.Pointer(decision_id="d1", image=NEW, digest=images.digest_of(NEW), adopted_at="t")
    assert images.pinned(eks, pointer).cluster.expect.image == NEW
    assert eks.cluster.expect.image != NEW  # the caller's config is not changed
    assert images.pinned(eks, None) == eks
    canary = eks.model_copy(deep=True)
    canary.cluster.kubernetes.raycluster = "tuneproof-canary-x"
    canary.cluster.expect.image = OLD
    assert images.pinned(canary, pointer).cluster.expect.image == OLD  # a canary runs its candidate
    local = load_config(PROJECT_ROOT / "configs" / "local.yaml")
    assert images.pinned(local, pointer) == local


def test_the_pipeline_reads_the_pointer_from_the_runs_storage_only_on_eks(tmp_path):
    storage = Storage(str(tmp_path))
    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml", [f"storage.root={tmp_path}"])
    assert images.pin_from_pointer(storage, eks) == eks  # nothing adopted yet: the profile's image
    adopted = decision("20261201-140000-aaaaaa", NEW)
    images.adopt(storage, adopted, None, "t")
    assert images.pin_from_pointer(storage, eks).cluster.expect.image == NEW
    storage.write_bytes(b"{torn", "images", "current.json")
    with pytest.raises(images.ImagesUnreadable, match="current.json"):  # the flow refuses: nothing runs on a guess
        images.pin_from_pointer(storage, eks)
    local = load_config(PROJECT_ROOT / "configs" / "local.yaml", [f"storage.root={tmp_path}"])
    assert images.pin_from_pointer(storage, local) == local  # never read locally
