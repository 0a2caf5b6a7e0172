"""The images registry: the canary's decision as a specification, the append-only history and the pointer."""

from __future__ import annotations

import threading

import pytest
from pydantic import TypeAdapter, ValidationError

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
        decision=verdict,  # type: ignore[arg-type]
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


def test_one_run_each_compares_by_the_threshold():
    base = decision(
        "d1", OLD, finetune__tokens_per_s=[1000.0], finetune__final_loss=[0.50], eval__candidate__exact_match=[0.9]
    )
    same = {"finetune.tokens_per_s": [960.0], "finetune.final_loss": [0.52], "eval.candidate.exact_match": [0.92]}
    verdict, reasons, compared = decide(None, base, same, 0.1)
    assert verdict == "adopt" and "3 compared, 0 better" in reasons[0]
    assert {m.name: m.verdict for m in compared} == dict.fromkeys(same, "no detectable difference")

    slower = {**same, "finetune.tokens_per_s": [700.0]}
    verdict, reasons, _ = decide(None, base, slower, 0.1)
    assert verdict == "reject"
    assert reasons == [
        "finetune.tokens_per_s: worse (higher is better): baseline median 1000, candidate median 700 (ratio 0.700, "
        "one value per side, no interval: a rerun with --repeats 3 on both sides tells noise from change)"
    ]
    lossier = {**same, "finetune.final_loss": [0.80]}
    assert decide(None, base, lossier, 0.1)[1][0].startswith("finetune.final_loss: worse (lower is better)")


def test_repeats_on_both_sides_use_the_t_interval():
    base = decision("d1", OLD, finetune__tokens_per_s=[1000.0, 1010.0, 990.0])
    noisy = {"finetune.tokens_per_s": [700.0, 1300.0, 1000.0]}
    verdict, reasons, compared = decide(None, base, noisy, 0.1)
    assert verdict == "adopt" and compared[0].ci95 is not None
    assert compared[0].verdict == "insufficient repeats"  # three noisy repeats cannot say worse, nor equal
    assert reasons[1].startswith("finetune.tokens_per_s: insufficient repeats to tell a 10% change from noise (")
    slower = {"finetune.tokens_per_s": [700.0, 710.0, 690.0]}
    verdict, reasons, compared = decide(None, base, slower, 0.1)
    assert verdict == "reject" and "95% CI" in reasons[0]


def test_a_metric_the_candidate_no_longer_reports_rejects():
    base = decision("d1", OLD, **{"connectivity__busbw_GBps@1048576B": [2.0]})
    verdict, reasons, _ = decide(None, base, {}, 0.1)
    assert verdict == "reject"
    assert reasons == ["connectivity.busbw_GBps@1048576B: measured on the baseline, not by the candidate"]


def test_an_untrained_zero_baseline_compares_absolutely():
    base = decision("d1", OLD, eval__base__exact_match=[0.0])
    assert decide(None, base, {"eval.base.exact_match": [0.0]}, 0.1)[0] == "adopt"
    assert decide(None, base, {"eval.base.exact_match": [0.5]}, 0.1)[2][0].verdict == "better"


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
