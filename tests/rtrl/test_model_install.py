"""`rtrl model install`: a shipped base or a Hugging Face model directory, checked against its
SHA256SUMS and installed atomically (compose's model-init job)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.bases import DEFAULT_BASE, SUMS_FILE, shipped_base_dir, verify_base


def install(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "model", "install", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )


def downloaded_model(directory: Path) -> Path:
    """A model as a download leaves it: the files, one in a subdirectory, and no sums."""
    shutil.copytree(shipped_base_dir(DEFAULT_BASE), directory)
    (directory / SUMS_FILE).unlink()
    (directory / "original").mkdir()
    shutil.move(directory / "bootstrap.json", directory / "original" / "params.json")
    return directory


def sha256sum_lines(directory: Path) -> str:
    """`sha256sum` run over every file in `directory` as an operator would: `./` paths, some
    in binary mode (`*`)."""
    lines = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        marker = "*" if path.suffix == ".safetensors" else " "
        lines.append(f"{digest} {marker}./{path.relative_to(directory).as_posix()}\n")
    return "".join(lines)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    source = downloaded_model(tmp_path / "coder")
    (source / SUMS_FILE).write_text(sha256sum_lines(source))
    return source


def test_a_model_directory_is_installed_checked_and_then_left_alone(
    model: Path, tmp_path: Path
) -> None:
    target = tmp_path / "models" / "base"
    done = install(str(model), "--to", str(target))
    assert done.returncode == 0, done.stderr
    assert f"installed at {target}" in done.stdout
    installed = verify_base(target)
    assert installed.checksum == verify_base(model).checksum
    assert (target / "original" / "params.json").read_bytes() == (
        model / "original" / "params.json"
    ).read_bytes()
    # Nothing but the model itself is left beside it.
    assert sorted(p.name for p in target.parent.iterdir()) == ["base"]

    again = install(str(model), "--to", str(target))
    assert again.returncode == 0 and "already installed, nothing to do" in again.stdout


def test_a_file_that_differs_from_its_checksum_is_refused_and_nothing_is_installed(
    model: Path, tmp_path: Path
) -> None:
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    target = tmp_path / "models" / "base"
    for flags in ([], ["--no-verify"]):  # --no-verify never overrides a mismatch
        refused = install(str(model), "--to", str(target), *flags)
        assert refused.returncode == 1
        assert "model.safetensors does not match its checksum" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert not target.parent.exists() or list(target.parent.iterdir()) == []


def test_a_model_without_checksums_needs_no_verify_and_is_then_checked_from_its_install(
    tmp_path: Path,
) -> None:
    source = downloaded_model(tmp_path / "coder")
    target = tmp_path / "models" / "base"
    refused = install(str(source), "--to", str(target))
    assert refused.returncode == 1
    assert f"{source} has no SHA256SUMS" in refused.stderr and "--no-verify" in refused.stderr
    assert not target.exists()

    done = install(str(source), "--to", str(target), "--no-verify")
    assert done.returncode == 0, done.stderr
    # The sums of the files as they were read, written into the copy: from now on the
    # installed model is checked like any other.
    assert (target / SUMS_FILE).read_text() == sha256sum_lines(source).replace(
        " *./", "  "
    ).replace("  ./", "  ")
    assert install(str(source), "--to", str(target), "--no-verify").returncode == 0
    (target / "config.json").write_text("{}")
    corrupted = install(str(source), "--to", str(target), "--no-verify")
    assert corrupted.returncode == 1 and "config.json does not match" in corrupted.stderr


def test_a_shipped_base_by_name_and_refusals_that_name_the_way_out(tmp_path: Path) -> None:
    target = tmp_path / "base"
    assert install(DEFAULT_BASE, "--to", str(target)).returncode == 0
    assert verify_base(target).checksum == verify_base(shipped_base_dir(DEFAULT_BASE)).checksum

    cluttered = tmp_path / "cluttered"
    cluttered.mkdir()
    (cluttered / "notes.txt").write_text("not a model")
    refused = install(DEFAULT_BASE, "--to", str(cluttered))
    assert refused.returncode == 1 and "is not empty and holds no model" in refused.stderr

    unknown = install("qwen-coder", "--to", str(tmp_path / "other"))
    assert unknown.returncode == 1
    assert "neither a shipped base (rtrl-base, rtrl-base-500) nor a directory" in unknown.stderr
