"""The base models rtrl ships, and the identity every bootstrapped base carries.

A base directory (as `rtrl model bootstrap` writes it) holds the weights in safetensors, the
tokenizer, the config, `bootstrap.json` (the recipe, seed, steps, loss, held-out figures and
the machine that built it) and `SHA256SUMS` (one line per other file, in `sha256sum`'s format,
so `sha256sum -c SHA256SUMS` checks it from a shell too). The base's checksum is the SHA-256
of `SHA256SUMS`: it names weights, tokenizer and recipe together.

The shipped bases live beside this file, one directory each, and are copied into a data dir
instead of being trained there: the same base on every machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

SUMS_FILE = "SHA256SUMS"
RECIPE_FILE = "bootstrap.json"
SHIPPED_DIR = Path(__file__).parent

DEFAULT_BASE = "rtrl-base"
"""The base `rtrl up`, the demo and the agent tests start from: 1,000 steps and more while
the agent-run check asks for them."""
HACKING_BASE = "rtrl-base-500"
"""The 500-step base of the reward-hacking scenario and of most weight-needing tests."""
SHIPPED_BASES = (DEFAULT_BASE, HACKING_BASE)


class BaseModelError(Exception):
    """A base model that is missing, incomplete or not what its checksums say."""


@dataclass(frozen=True)
class BaseIdentity:
    """What a base is: its name, its checksum and the recipe that built it."""

    name: str
    checksum: str
    """SHA-256 of its `SHA256SUMS`; empty for a base that carries none (a model from
    elsewhere, which rtrl cannot vouch for)."""
    recipe: dict[str, Any]
    """`bootstrap.json`: config, seed, steps, loss, held-out figures, machine."""
    path: Path

    def describe(self) -> str:
        """One line: name, short checksum, and the recipe's seed, steps and held-out pass."""
        if not self.checksum:
            return f"{self.name} at {self.path} (no {SUMS_FILE}: not verified)"
        recipe = self.recipe
        figures = ""
        if "heldout_pass_greedy" in recipe:
            figures = (
                f", held-out pass {recipe['heldout_pass_greedy']:.2f} greedy"
                f" / {recipe['heldout_pass_sampled']:.2f} sampled"
            )
        solved = recipe.get("agent_solved_check")
        check = "" if solved is None else f", {solved:.0%} of validation agent runs solved"
        return (
            f"{self.name} sha256:{self.checksum[:12]} (seed {recipe.get('seed')},"
            f" {recipe.get('train_steps')} steps{figures}{check})"
        )


def file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def write_checksums(model_dir: Path) -> str:
    """Write `SHA256SUMS` for every other file in `model_dir`; returns the base's checksum."""
    lines = [
        f"{file_sha256(path)}  {path.name}\n"
        for path in sorted(model_dir.iterdir())
        if path.is_file() and path.name != SUMS_FILE
    ]
    text = "".join(lines)
    (model_dir / SUMS_FILE).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def verify_base(model_dir: Path, name: str | None = None) -> BaseIdentity:
    """The identity of the base in `model_dir`, after checking every file its `SHA256SUMS`
    lists; raises `BaseModelError`, naming the file, when one is missing or differs, or when
    a file sits beside them that the sums do not cover. A directory without `SHA256SUMS` (a
    model from elsewhere) is returned unverified, with an empty checksum."""
    model_dir = Path(model_dir)
    label = name or model_dir.name
    if not (model_dir / "config.json").is_file():
        raise BaseModelError(f"no base model at {model_dir} (no config.json)")
    sums_path = model_dir / SUMS_FILE
    recipe = _read_recipe(model_dir)
    if not sums_path.is_file():
        return BaseIdentity(label, "", recipe, model_dir)
    text = sums_path.read_text()
    listed: dict[str, str] = {}
    for line in text.splitlines():
        # sha256sum's format: the digest, a space, then a space (text) or `*` (binary mode).
        digest, marker, file_name = line[:64], line[64:66], line[66:].removeprefix("./")
        if len(digest) != 64 or marker not in ("  ", " *") or not file_name:
            raise BaseModelError(f"{sums_path} is not a sha256sum list (line {line!r})")
        listed[file_name] = digest
    for file_name, digest in listed.items():
        path = model_dir / file_name
        if not path.is_file():
            raise BaseModelError(
                f"base model {label} at {model_dir} is incomplete: {file_name} is missing"
                f" ({_remedy(model_dir)})"
            )
        if file_sha256(path) != digest:
            raise BaseModelError(
                f"base model {label} at {model_dir}: {file_name} does not match its checksum"
                f" in {SUMS_FILE}, so it is not the base that was built ({_remedy(model_dir)})"
            )
    extra = sorted(
        path.name
        for path in model_dir.iterdir()
        if path.is_file() and path.name not in listed and path.name != SUMS_FILE
    )
    if extra:
        raise BaseModelError(
            f"base model {label} at {model_dir}: {', '.join(extra)} not covered by {SUMS_FILE}"
            f" ({_remedy(model_dir)})"
        )
    return BaseIdentity(label, hashlib.sha256(text.encode()).hexdigest(), recipe, model_dir)


def shipped_base_dir(name: str) -> Path:
    """Where the shipped base `name` lies in the installed package."""
    if name not in SHIPPED_BASES:
        raise BaseModelError(f"no shipped base named {name!r}; shipped: {', '.join(SHIPPED_BASES)}")
    return SHIPPED_DIR / name


def install_base(name: str, model_dir: Path) -> BaseIdentity:
    """Put the shipped base `name` at `model_dir` (checked before and after the copy) unless
    that directory already holds it; a directory that holds another base, or a corrupted one,
    is refused with `BaseModelError` rather than overwritten."""
    return install_model(shipped_base_dir(name), model_dir, name=name)


def install_model(
    source: Path, model_dir: Path, *, name: str | None = None, verify: bool = True
) -> BaseIdentity:
    """Put the model in `source` at `model_dir`, atomically, unless that directory already
    holds it; a directory holding another model, or a corrupted one, is refused with
    `BaseModelError` rather than overwritten.

    Every file is checked against the source's `SHA256SUMS` before and after the copy, and a
    source without one is refused. With `verify=False` such a source is taken as it reads:
    its sums are computed during the install and written into the copy, so the installed
    model is checked from then on (a source that has `SHA256SUMS` is checked all the same).
    """
    source, model_dir = Path(source), Path(model_dir)
    label = name or source.name
    wanted = verify_base(source, label)
    sums = ""
    if not wanted.checksum:
        if verify:
            raise BaseModelError(
                f"{source} has no {SUMS_FILE}, so its files cannot be checked: write one"
                f" where the model was downloaded and checked (`sha256sum * > {SUMS_FILE}` in"
                " its directory), or install it unchecked (`rtrl model install --no-verify`)"
            )
        sums = _checksum_lines(source)
        wanted = replace(wanted, checksum=hashlib.sha256(sums.encode()).hexdigest())
    if (model_dir / "config.json").is_file():
        present = verify_base(model_dir)
        if present.checksum != wanted.checksum:
            raise BaseModelError(
                f"{model_dir} holds another base than {label} ({present.describe()}); point"
                f" RTRL_BASE_MODEL at it to use it, or remove {model_dir} to install {label}"
                " there"
            )
        return replace(present, name=label)
    if model_dir.is_dir() and any(model_dir.iterdir()):
        raise BaseModelError(f"{model_dir} is not empty and holds no model; remove it first")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        copied = scratch / "base"
        shutil.copytree(source, copied)
        for path in [copied, *copied.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if sums:
            (copied / SUMS_FILE).write_text(sums)
        copy = verify_base(copied, label)
        if copy.checksum != wanted.checksum:
            raise BaseModelError(f"{source} changed while it was copied; install it again")
        os.replace(copied, model_dir)  # atomic: the files checked are the files installed
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return replace(copy, path=model_dir)


def _checksum_lines(model_dir: Path) -> str:
    """`SHA256SUMS` for every file under `model_dir` (but itself), by path within it."""
    return "".join(
        f"{file_sha256(path)}  {path.relative_to(model_dir).as_posix()}\n"
        for path in sorted(model_dir.rglob("*"))
        if path.is_file() and path != model_dir / SUMS_FILE
    )


def _read_recipe(model_dir: Path) -> dict[str, Any]:
    path = model_dir / RECIPE_FILE
    if not path.is_file():
        return {}
    try:
        recipe = json.loads(path.read_text())
    except ValueError as exc:
        raise BaseModelError(f"{path} is not JSON: {exc}") from None
    return recipe if isinstance(recipe, dict) else {}


def _remedy(model_dir: Path) -> str:
    return (
        f"remove {model_dir} so rtrl installs the shipped base again, or rebuild it with"
        " `rtrl model bootstrap --force`"
    )
