"""`tuneproof lint` and images/current.json: EKS runs pin the adopted image, so the manifests must run it.

    python -m pytest -q tests/test_lint_images.py

The storage root here is a local directory (the pointer is read from it; lint reads an S3 root's pointer
only with --read-pointer), so lint also reports that such a root is not shared by the pods: these tests
look only at the image findings.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_lint_eks import EKS, lint, lint_failed, project  # noqa: F401 - the fixture
from tuneproof.app.cli_eks import lint_command
from tuneproof.control import images
from tuneproof.core.storage import Storage

PLACEHOLDER = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1@sha256:" + "0" * 64
ADOPTED = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2@sha256:" + "b" * 64


def adopt(root: Path, image: str) -> None:
    storage = Storage(str(root))
    decision = images.Decision(
        decision_id="20261201-140000-aaaaaa",
        candidate_image=image,
        digest=images.digest_of(image),
        profile="eks",
        threshold=0.1,
        decision="adopt",
        reasons=["test"],
        decided_at="t",
    )
    images.create_decision(storage, decision)
    images.adopt(storage, decision, None, "t")


def image_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "].image is" in line and "RayCluster" in line]


def test_manifests_that_do_not_run_the_adopted_image_are_errors_naming_both_digests(project, capsys, tmp_path):
    root = tmp_path / "storage"
    adopt(root, ADOPTED)
    out = lint_failed(project, capsys, f"storage.root={root}")
    errors = [line for line in image_lines(out) if line.startswith("ERROR")]
    assert len(errors) == 2  # the head's and the GPU workers' Ray containers
    for line in errors:
        assert PLACEHOLDER in line and ADOPTED in line and "images/current.json" in line
    assert "and the image" in out and "names (decision 20261201-140000-aaaaaa)" in out


def test_manifests_running_the_adopted_image_pass_though_the_profile_still_names_the_old_one(project, capsys, tmp_path):
    root = tmp_path / "storage"
    adopt(root, PLACEHOLDER)
    # The profile pins another digest; EKS runs take the pointer's, so that is what the manifests must run.
    code, out = lint(project, capsys, f"storage.root={root}", f"cluster.expect.image={ADOPTED}")
    assert [line for line in image_lines(out) if line.startswith("ERROR")] == []
    # Without a pointer the profile's image applies, and the same manifests are an error.
    code, out = lint(project, capsys, f"storage.root={tmp_path / 'empty'}", f"cluster.expect.image={ADOPTED}")
    assert len([line for line in image_lines(out) if line.startswith("ERROR")]) == 2
    assert "no image adopted yet under" in out


def test_an_unreadable_pointer_is_named_and_lint_goes_on(project, capsys, tmp_path):
    root = tmp_path / "storage"
    Storage(str(root)).write_bytes(b"{torn", "images", "current.json")
    code, out = lint(project, capsys, f"storage.root={root}")
    warning = next(line for line in out.splitlines() if "cannot read the adopted image" in line)
    assert warning.startswith("WARNING") and "current.json" in warning and "not a current-image pointer" in warning
    assert "lint of" in out.splitlines()[-1]


def test_an_s3_pointer_is_read_only_when_asked(project, capsys):
    code = lint_command([str(project / "deployments"), str(project / "prefect.yaml")], str(EKS), [])
    out = capsys.readouterr().out
    assert code == 0 and "s3://tuneproof-artifacts/pipeline/images/current.json not read: --read-pointer" in out
