"""Wheels for the offline GPU host: download them here, carry them in parts, install them there.

The GPU host runs CPython 3.12 with torch and Triton preinstalled, and has no network.

- `download` (a networked machine; `nox -s gpu-wheels`): the pinned sglang cp312 wheel and
  megatron-core sdist (third_party/*/upstream.toml, sha256-checked by `pins.fetch`) and the
  wheels pinned in gpu-host-requirements.txt (`pip download --no-deps`, cp312 manylinux or pure
  Python). Every Requires-Dist of every wheel must be met by a shipped wheel, the host's torch
  and Triton, or an `exclude` line of the requirements file. The files are split into folders
  `part-NN/` of at most 60 MiB, each with the same manifest (name, version, sha256, size).
- `install` (the GPU host): every file is checked against the manifest before anything is
  installed; the wheels go in with `pip install --no-index --no-deps`; the two engines are then
  patched and built as `nox -s build` does (`tree.apply`, then `install_tree.installable`) and
  installed with onpolicy, and `sglang`, `megatron.core` and `onpolicy` are imported.
- the lean bundle (`python -m onpolicy.upstream.gpu_lean build|install`): one folder under the
  64 MiB call limit holding only what the host lacks (gpu-host-lean.txt) and the two patched
  engines, installed with `pip --target` into a folder put on PYTHONPATH.

docs/gpu-host.md has the steps.
"""

from __future__ import annotations

import argparse
import email
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from onpolicy.upstream import parts, tree
from onpolicy.upstream.cli import find_root
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.install_tree import installable
from onpolicy.upstream.pins import Pin, fetch, load_pin, sha256_of

REQUIREMENTS = Path(__file__).with_name("gpu-host-requirements.txt")
ARCHIVE = "cp312"
PINNED = {"megatron-lm": None, "sglang": ARCHIVE}
"""The patched upstreams, shipped as their pinned archives: series -> archive (None: the pin's)."""
PIP_DOWNLOAD = (
    "download --only-binary=:all: --no-deps --python-version=3.12 --implementation=cp "
    "--abi=cp312 --progress-bar=off"
).split()
PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)))
"""pip does not widen a --platform to older glibc minors, so every manylinux tag up to the host's
glibc 2.39 is named (sglang's wheel is manylinux_2_34, llguidance's manylinux_2_31)."""
HOST = {"torch": "2.11.0+cu130", "triton": "3.6.0"}
"""Preinstalled on the GPU host; requirements on them are checked against these versions."""
NEVER = ("torch", "triton", "nvidia-*", "sglang-kernel", "sgl-kernel", "flashinfer*")
"""Never shipped: the host has torch, Triton and torch's CUDA libraries; the rest cannot be
installed there."""
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
"""The host, for evaluating Requires-Dist markers."""

PIN_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")
EXCLUDE_LINE = re.compile(r"^#\s*exclude\s+([A-Za-z0-9._*-]+):\s*(\S.*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, kw_only=True, slots=True)
class Requirements:
    """gpu-host-requirements.txt."""

    pins: dict[str, str]
    """Canonical project name -> its pinned version."""
    excluded: dict[str, str]
    """Name or pattern (`nvidia-*`) of a package not shipped -> why."""


def read_requirements(path: Path = REQUIREMENTS) -> Requirements:
    """The pins and exclusions; refuses a line that is not `NAME==VERSION`, a duplicate, and a pin
    of a package that must not be shipped (NEVER) or is excluded in the file."""
    lines = path.read_text().splitlines()
    excluded = {
        canonical(m[1]): m[2] for m in (EXCLUDE_LINE.match(line.strip()) for line in lines) if m
    }
    pins: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = PIN_LINE.match(line)
        if not m:
            raise UpstreamError(f"{path.name}:{n}: {line!r} is not pinned as NAME==VERSION")
        name = canonical(m[1])
        if name in pins:
            raise UpstreamError(f"{path.name}:{n}: {name} is pinned twice")
        bad = [p for p in (*NEVER, *excluded) if fnmatch.fnmatchcase(name, p)]
        if bad:
            raise UpstreamError(f"{path.name}:{n}: {name} must not be shipped (matches {bad[0]!r})")
        pins[name] = m[2]
    return Requirements(pins=pins, excluded=excluded)


def wheel_name(file: str) -> tuple[str, str]:
    """(canonical name, version) from a wheel's file name."""
    name, version = file.split("-")[:2]
    return canonical(name), version


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(meta) != 1:
            raise UpstreamError(f"{wheel.name}: expected one */METADATA, got {meta}")
        return email.message_from_bytes(z.read(meta[0])).get_all("Requires-Dist") or []


def unmet(wheels: list[Path], reqs: Requirements, host: dict[str, str] = HOST):
    """(problems, notes) for the Requires-Dist of `wheels` on the host. A problem: a requirement
    that no shipped wheel meets and that is neither on the host nor excluded. A note: one on an
    excluded package, or on a host package whose version does not meet it."""
    from packaging.requirements import Requirement  # download side only; the host needs none

    meta = {}
    for w in wheels:
        name, version = wheel_name(w.name)
        meta[name] = (version, [Requirement(r) for r in requires_dist(w)])
    extras: dict[str, set[str]] = {n: set() for n in meta}

    def applies(r, asked: set[str]) -> bool:
        return r.marker is None or any(
            r.marker.evaluate({**TARGET, "extra": e}) for e in {"", *asked}
        )

    # Extras asked for by a shipped wheel (fsspec[http]) add that wheel's requirements.
    changed = True
    while changed:
        changed = False
        for n, (_, rs) in meta.items():
            for r in rs:
                dep = canonical(r.name)
                if dep in meta and applies(r, extras[n]) and not set(r.extras) <= extras[dep]:
                    extras[dep] |= set(r.extras)
                    changed = True
    problems, notes = [], []
    for n, (v, rs) in sorted(meta.items()):
        for r in (r for r in rs if applies(r, extras[n])):
            dep = canonical(r.name)
            why = reqs.excluded.get(dep) or next(
                (w for p, w in reqs.excluded.items() if fnmatch.fnmatchcase(dep, p)), None
            )
            if dep in meta:
                if not r.specifier.contains(meta[dep][0], prereleases=True):
                    problems.append(f"{n} {v} needs {r}; shipped: {dep} {meta[dep][0]}")
            elif dep in host:
                if not r.specifier.contains(host[dep], prereleases=True):
                    notes.append(f"{n} needs {r}; the host has {dep} {host[dep]}")
            elif why is not None:
                notes.append(f"{n} needs {r}: not shipped ({why})")
            else:
                problems.append(f"{n} {v} needs {r}: not shipped, not on the host, not excluded")
    return problems, notes


def _inputs_key(root: Path, cap: int) -> str:
    h = hashlib.sha256(f"{ARCHIVE}\0{cap}\0{' '.join(PLATFORMS)}\0".encode())
    for f in [REQUIREMENTS, *(root / "third_party" / n / "upstream.toml" for n in PINNED)]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def download(root: Path, out: Path, *, cap: int = parts.CAP) -> dict:
    """Fetch, check and split everything the host installs into out/part-NN/; skipped when the
    inputs (requirements, pins, platforms, cap) are unchanged and the parts still verify."""
    reqs = read_requirements()
    key = _inputs_key(root, cap)
    if (out / parts.MANIFEST).is_file():
        manifest = json.loads((out / parts.MANIFEST).read_text())
        if manifest.get("inputs") == key:
            try:
                parts.verify(out, parts.items(manifest))
                print(f"{out}: up to date (inputs {key})")
                return manifest
            except UpstreamError as e:
                print(f"{out}: downloading again ({e})")
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", *PIP_DOWNLOAD, *(f"--platform={p}" for p in PLATFORMS)]
    cmd += ["-d", str(staging), "-r", str(REQUIREMENTS)]
    if subprocess.run(cmd).returncode != 0:
        raise UpstreamError(
            "pip download failed (above). A package with no cp312 or pure-Python "
            "wheel: if it is pure Python, build it with `pip wheel --no-deps "
            "NAME==VERSION` and ship that"
        )
    got = {wheel_name(f.name): f for f in staging.glob("*.whl")}
    want = set(reqs.pins.items())
    if set(got) != want:
        raise UpstreamError(
            f"pip download gave {sorted(set(got) - want)} beyond the pins and "
            f"lacks {sorted(want - set(got))}"
        )
    files = [(f, name, version, None) for (name, version), f in sorted(got.items())]
    for series, archive in PINNED.items():
        pin = load_pin(root, series, archive=archive)
        shutil.copyfile(fetch(root, pin), staging / pin.file)
        files.append((staging / pin.file, canonical(pin.package), pin.version, series))
    problems, notes = unmet([f for f, *_ in files if f.name.endswith(".whl")], reqs)
    print("Requirements left to the host or excluded:\n  " + "\n  ".join(notes))
    if problems:
        raise UpstreamError("unmet requirements on the host:\n  " + "\n  ".join(problems))
    manifest = parts.bundle(files, out, cap=cap, inputs=key)
    shutil.rmtree(staging)
    print(parts.summary(manifest))
    return manifest


def _stage(archive: Path, downloads: Path, pin: Pin) -> None:
    """Put the checked archive where `pins.fetch` looks, so `tree.apply` needs no network."""
    if archive.name != pin.file:
        raise UpstreamError(f"{archive.name} is not the pinned {pin.file}; download again")
    downloads.mkdir(parents=True, exist_ok=True)
    dest = downloads / pin.file
    if not dest.is_file() or sha256_of(dest) != pin.sha256:
        shutil.copyfile(archive, dest)


def patched_megatron(root: Path, sdist: Path) -> Path:
    """The megatron-lm series applied to the pinned sdist and exported, as `nox -s build` does."""
    _stage(sdist, root / "build" / "downloads", load_pin(root, "megatron-lm"))
    tree.apply(root, "megatron-lm")
    return installable(root, "megatron-lm")


def patched_sglang(root: Path, wheel: Path) -> Path:
    """The sglang series applied to the cp312 wheel and repacked, by the functions `nox -s build`
    uses for cp311 (`tree.apply`, `install_tree.installable`). They take the archive from the
    pin, so they run in build/gpu-host/: a root whose sglang pin selects cp312 and whose patches/
    is the repo's own (the repo's build/upstream/sglang is left as it is)."""
    alt = root / "build" / "gpu-host"
    text, n = re.subn(
        r'^archive = "[^"]*"$',
        f'archive = "{ARCHIVE}"',
        (root / "third_party/sglang/upstream.toml").read_text(),
        flags=re.M,
    )
    if n != 1:
        raise UpstreamError('third_party/sglang/upstream.toml has no single `archive = "..."` line')
    toml = alt / "third_party" / "sglang" / "upstream.toml"
    toml.parent.mkdir(parents=True, exist_ok=True)
    if not toml.is_file() or toml.read_text() != text:
        toml.write_text(text)
    if not (alt / "patches").is_symlink():
        (alt / "patches").symlink_to(root / "patches", target_is_directory=True)
    _stage(wheel, alt / "build" / "downloads", load_pin(alt, "sglang"))
    tree.apply(alt, "sglang")
    return installable(alt, "sglang")


def check_imports(
    modules: tuple[str, ...] = ("sglang", "megatron.core", "onpolicy"),
    *,
    pythonpath: str | None = None,
) -> None:
    """Import each module in a fresh interpreter (this one, outside the repo), with `pythonpath`
    as its only PYTHONPATH (the lean install's folder) or none (the venv `install` filled)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    failed = []
    for m in modules:
        code = f"import {m} as m; print(getattr(m, '__version__', '-'), m.__file__)"
        p = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tempfile.gettempdir(),
            env=env,
            capture_output=True,
            text=True,
        )
        print(f"import {m}: " + (p.stdout.strip() if p.returncode == 0 else "FAILED"))
        if p.returncode != 0:
            print(p.stderr.strip()[-3000:], file=sys.stderr)
            failed.append(m)
    if failed:
        raise UpstreamError(f"cannot import {', '.join(failed)} (above)")


def install(root: Path, wheels: Path, *, part: int | None = None) -> None:
    """Check, then install: with `part`, only the plain wheels lying whole in that part; without,
    everything (every part must be here), then the patched engines and onpolicy, then imports."""
    manifest = parts.load_manifest(wheels)
    every = parts.items(manifest)
    if part is None:
        missing = [
            k for k in range(1, manifest["parts"] + 1) if not parts.part_dir(wheels, k).is_dir()
        ]
        if missing:
            raise UpstreamError(
                f"parts {missing} of {manifest['parts']} are not in {wheels}; "
                "carry them (or install the parts here one by one: --part N)"
            )
        chosen = every
    else:
        if not 1 <= part <= manifest["parts"]:
            raise UpstreamError(f"no part {part}: the manifest has parts 1..{manifest['parts']}")
        chosen = [i for i in every if i.series is None and {p.part for p in i.pieces} == {part}]
    checked = parts.verify(wheels, chosen)  # everything, before anything is installed
    paths = {f: parts.joined(ps, wheels / "joined" / f) for f, ps in checked.items()}
    if shutil.which("git") is None and part is None:
        raise UpstreamError("git is needed to apply the patch series (as `nox -s build` does)")
    links = [f"--find-links={d}" for d in sorted(wheels.glob("part-*")) if d.is_dir()]
    pip = [sys.executable, "-m", "pip", "install", "--no-index", *links, "--no-deps"]
    plain = [str(paths[i.file]) for i in chosen if i.series is None]
    if plain:
        _run([*pip, *plain])
    if part is not None:
        print(f"part {part}: {len(chosen)} wheels installed; `install` without --part finishes")
        return
    archives = {i.series: paths[i.file] for i in chosen if i.series}
    _run([*pip, str(patched_megatron(root, archives["megatron-lm"]))])
    _run([*pip, "--force-reinstall", str(patched_sglang(root, archives["sglang"]))])
    _run([*pip, "-e", str(root)])
    check_imports()


def _run(cmd: list[str]) -> None:
    if subprocess.run(cmd).returncode != 0:
        raise UpstreamError(f"failed: {' '.join(cmd[:6])} ...")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m onpolicy.upstream.gpu_wheels", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--root", type=Path, default=None, help="repo root (default: search upward)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("download", help="networked machine: download, check, split, manifest")
    p.add_argument("--out", type=Path, default=None, help="default: build/wheels-cp312")
    p.add_argument("--cap-mib", type=int, default=parts.CAP >> 20, help="part size limit (MiB)")
    for cmd, text in [
        ("verify", "check the parts here against the manifest"),
        ("install", "GPU host: check, install offline, patch, import"),
    ]:
        p = sub.add_parser(cmd, help=text)
        p.add_argument("--wheels", type=Path, required=True, help="the folder holding part-NN/")
        p.add_argument("--part", type=int, default=None, help="only this part")
    sub.add_parser("check", help="import sglang, megatron.core and onpolicy")
    args = ap.parse_args(argv)
    try:
        root = args.root.resolve() if args.root else find_root()
        if args.cmd == "download":
            download(root, args.out or root / "build" / "wheels-cp312", cap=args.cap_mib << 20)
        elif args.cmd == "verify":
            manifest = parts.load_manifest(args.wheels)
            its = parts.items(manifest)
            parts.verify(args.wheels, its, part=args.part)
            n = sum(args.part in (None, p.part) for i in its for p in i.pieces)
            print(f"{n} files match the manifest" + (f" in part {args.part}" if args.part else ""))
        elif args.cmd == "install":
            install(root, args.wheels.resolve(), part=args.part)
        else:
            check_imports()
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
