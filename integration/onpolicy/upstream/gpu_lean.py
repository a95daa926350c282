"""The lean GPU-host bundle: what the exact SGLang engine and megatron-core need beyond the host's
own packages, in one folder that fits one call (64 MiB, the working tree included).

`python -m onpolicy.upstream.gpu_lean build|install` (`nox -s gpu-wheels -- --lean` runs
`build`):

- `build` (the networked machine, after gpu_wheels' `download`): the wheels pinned in
  gpu-host-lean.txt, taken from the download's parts (sha256-checked against its manifest);
  the patched sglang cp312 wheel (`patched_sglang`) as a .tar.xz without the Rust extensions
  the engine does not load and without sglang/test and sglang/benchmark; the patched megatron
  tree (`patched_megatron`) as a .tar.xz; a manifest of every file's sha256. A bundle over
  LIMIT is refused.
- `install` (the GPU host): checks every sha256 first, then `pip install --target` of the
  wheels and the two tar extractions into one folder, prints the PYTHONPATH to export and imports
  sglang, megatron.core and onpolicy in a fresh interpreter.
- `build-loop` / `install-loop`: what the GRPO loop adds (gpu-host-loop.txt: Ray and its
  requirements, torch-memory-saver), in parts of at most LIMIT (Ray's wheel alone is over one
  call, so it travels in two pieces), installed into a folder of its own.

docs/gpu-host.md has the steps.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from onpolicy.upstream import gpu_wheels, parts
from onpolicy.upstream.cli import find_root
from onpolicy.upstream.errors import UpstreamError
from onpolicy.upstream.pins import sha256_of

LEAN = Path(__file__).with_name("gpu-host-lean.txt")
LOOP = Path(__file__).with_name("gpu-host-loop.txt")
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
"""What one call to the GPU host carries, the working tree included."""
MARGIN = 4 * MIB
"""Left for the working tree, which travels with every call (about 2 MiB today)."""
LIMIT = CALL_LIMIT - MARGIN
MANIFEST = "lean-manifest.json"
SGLANG_TAR = "sglang-cp312-patched.tar.xz"
MEGATRON_TAR = "megatron.tar.xz"
DROP = (
    "sglang/srt/rust_extensions/_bench*",
    "sglang/srt/rust_extensions/_grpc*",
    "sglang/srt/rust_extensions/_multimodal*",
    "sglang/srt/rust_extensions/_server*",
    "sglang/test/*",
    "sglang/benchmark/*",
)
"""Left out of the sglang tarball: the Rust extensions of the benchmark, gRPC, multimodal and
server front ends (42 MB unpacked; imported only by the Rust server, multimodal processors and
HTTP entry point, which the exact engine does not load), and sglang's own tests and benchmarks.
sglang/srt/mem_cache/rust_tree_core (the radix tree's extension) is kept."""
INSTALLED = ".onpolicy-lean"
"""Written into a target `install` filled, so a later run may replace that folder."""
XZ_PRESET = 6
"""xz's default: preset 9 made sglang's files under 1% smaller at three times the time."""
FIXED_MTIME = 946684800  # 2000-01-01, as the patched trees' commits: the tarballs are reproducible


def read_lean(path: Path = LEAN, pins: dict[str, str] | None = None) -> dict[str, str]:
    """Canonical name -> version, each line `NAME==VERSION` and equal to the package's pin in
    gpu-host-requirements.txt (one pin per package: a version changes there first)."""
    pins = gpu_wheels.read_requirements().pins if pins is None else pins
    lean: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = gpu_wheels.PIN_LINE.match(line)
        if not m:
            raise UpstreamError(f"{path.name}:{n}: {line!r} is not pinned as NAME==VERSION")
        name = gpu_wheels.canonical(m[1])
        if name in lean:
            raise UpstreamError(f"{path.name}:{n}: {name} is listed twice")
        if pins.get(name) != m[2]:
            where = f"pins {pins[name]}" if name in pins else "does not pin it"
            raise UpstreamError(
                f"{path.name}:{n}: {name}=={m[2]}, but {gpu_wheels.REQUIREMENTS.name} {where}"
            )
        lean[name] = m[2]
    return lean


def dropped(member: str) -> bool:
    return any(fnmatch.fnmatchcase(member, p) for p in DROP)


def _info(name: str, size: int, executable: bool) -> tarfile.TarInfo:
    """A member with fixed owner and time, so the same input packs to the same bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, FIXED_MTIME, 0o755 if executable else 0o644
    return info


def _without(record: bytes, gone: set[str]) -> bytes:
    """The wheel's RECORD less the rows of the files left out (csv: some names hold commas)."""
    rows = [r for r in csv.reader(io.StringIO(record.decode())) if r and r[0] not in gone]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().encode()


def pack_sglang(wheel: Path, dest: Path) -> list[str]:
    """The wheel's files less DROP, as a .tar.xz to extract into a site folder (what pip --target
    would lay out). Returns the files left out."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if not n.endswith("/"))
        gone = [n for n in names if dropped(n)]
        with tarfile.open(dest, "w:xz", preset=XZ_PRESET) as t:
            for n in names:
                if n in gone:
                    continue
                data = z.read(n)
                if n.endswith(".dist-info/RECORD"):
                    data = _without(data, set(gone))
                executable = bool((z.getinfo(n).external_attr >> 16) & stat.S_IXUSR)
                t.addfile(_info(n, len(data), executable), io.BytesIO(data))
    return gone


def pack_tree(src: Path, dest: Path) -> int:
    """`src` (a package folder) as a .tar.xz whose members start with its name; no bytecode.
    Returns the number of files."""
    files = sorted(
        p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts[len(src.parts) :]
    )
    with tarfile.open(dest, "w:xz", preset=XZ_PRESET) as t:
        for p in files:
            name = p.relative_to(src.parent).as_posix()
            with p.open("rb") as f:
                executable = bool(p.stat().st_mode & stat.S_IXUSR)
                t.addfile(_info(name, p.stat().st_size, executable), f)
    return len(files)


def _refuse_over(total: int, limit: int, what: str) -> None:
    if total > limit:
        raise UpstreamError(
            f"{what} is {total:,} bytes ({total / MIB:.1f} MiB), over the limit of {limit:,} "
            f"bytes ({limit / MIB:.1f} MiB): one call carries at most {CALL_LIMIT / MIB:.0f} MiB, "
            f"the working tree included, so the bundle keeps {(CALL_LIMIT - limit) / MIB:.1f} MiB "
            f"free. Leave a package out of {LEAN.name}, or carry the parts (`install`)"
        )


def _replaceable(old: Path, marker: str = MANIFEST) -> None:
    """Refuse to replace a folder that is not empty and was not written by this module (it holds
    no `marker`, the manifest of what it built, and no INSTALLED)."""
    if old.exists() and any(old.iterdir()):
        if not (old / marker).is_file() and not (old / INSTALLED).exists():
            raise UpstreamError(f"{old} holds files this tool did not write; choose another path")


def _replace(old: Path, new: Path, marker: str = MANIFEST) -> None:
    _replaceable(old, marker)
    if old.exists():
        shutil.rmtree(old)
    os.replace(new, old)


def seal(staging: Path, out: Path, *, limit: int = LIMIT, inputs: dict | None = None) -> dict:
    """Write the manifest (each file's sha256 and size) into `staging`, refuse a bundle over
    `limit` (leaving `out` as it was), then move `staging` to `out`."""
    files = sorted(p for p in staging.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": 1,
        "inputs": inputs or {},
        "files": [
            {"file": p.relative_to(staging).as_posix(), "sha256": sha256_of(p),
             "size": p.stat().st_size}
            for p in files
        ],
    }  # fmt: skip
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    total = sum(f["size"] for f in manifest["files"]) + len(text.encode())
    try:
        _refuse_over(total, limit, f"the lean bundle ({len(files)} files)")
    except UpstreamError:
        shutil.rmtree(staging)
        raise
    (staging / MANIFEST).write_text(text)
    _replace(out, staging)
    return {**manifest, "total": total, "limit": limit}


def _copy(pieces: list[Path], dest: Path) -> None:
    if len(pieces) == 1:
        shutil.copyfile(pieces[0], dest)
    else:
        parts.joined(pieces, dest)


def _listed(wheels: Path, items: list[parts.Item], listed: dict[str, str]) -> list[parts.Item]:
    """The download's plain wheels that `listed` (name -> version) names, in its order; refused
    naming every one the download lacks at that version."""
    plain = {i.name: i for i in items if i.series is None}
    absent = [f"{n}=={v}" for n, v in listed.items() if n not in plain or plain[n].version != v]
    if absent:
        raise UpstreamError(f"not in {wheels}'s manifest: {absent}; run `nox -s gpu-wheels`")
    return [plain[n] for n in listed]


def build(root: Path, wheels: Path, out: Path, *, limit: int = LIMIT) -> dict:
    """The lean bundle in `out`, from the download's parts in `wheels` (`nox -s gpu-wheels`)."""
    lean = read_lean()
    _replaceable(out)
    manifest = parts.load_manifest(wheels)
    items = parts.items(manifest)
    chosen = _listed(wheels, items, lean)
    engines = {i.series: i for i in items if i.series}
    _refuse_over(sum(i.size for i in chosen), limit, f"the {len(chosen)} wheels alone")
    found = parts.verify(wheels, [*chosen, *engines.values()])  # sha256, before any work
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "wheels").mkdir(parents=True)
    for i in chosen:
        _copy(found[i.file], staging / "wheels" / i.file)
    arch = {s: parts.joined(found[i.file], wheels / "joined" / i.file) for s, i in engines.items()}
    gone = pack_sglang(gpu_wheels.patched_sglang(root, arch["sglang"]), staging / SGLANG_TAR)
    megatron = gpu_wheels.patched_megatron(root, arch["megatron-lm"]) / "megatron"
    pack_tree(megatron, staging / MEGATRON_TAR)
    inputs = {"download": manifest["inputs"], "lean_list": sha256_of(LEAN)}
    sealed = seal(staging, out, limit=limit, inputs=inputs)
    print(f"sglang: left out {len(gone)} files ({', '.join(DROP)})")
    print(
        f"{out}: {len(chosen)} wheels, {SGLANG_TAR}, {MEGATRON_TAR}; {sealed['total']:,} bytes "
        f"({sealed['total'] / MIB:.1f} MiB) of at most {limit / MIB:.1f} MiB"
    )
    return sealed


def verify(bundle: Path) -> dict:
    """Every file of the bundle's manifest, present and with its sha256; writes nothing."""
    path = bundle / MANIFEST
    if not path.is_file():
        raise UpstreamError(f"no {MANIFEST} in {bundle}: carry the folder `lean` wrote")
    manifest = json.loads(path.read_text())
    for f in manifest["files"]:
        p = bundle / f["file"]
        if not p.is_file():
            raise UpstreamError(f"{p} is missing; carry the whole {bundle.name}/ folder")
        parts._check(p, f["sha256"], sha256_of(p))
    return manifest


def install(root: Path, bundle: Path, target: Path) -> str:
    """Check every sha256, then fill `target` (pip --target, the two tarballs), print the
    PYTHONPATH to export and import the engines with it. Returns that PYTHONPATH."""
    manifest = verify(bundle)  # before anything is written
    _replaceable(target)
    staging = target.parent / f".{target.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    wheels = [str(bundle / f["file"]) for f in manifest["files"] if f["file"].endswith(".whl")]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    gpu_wheels._run([*pip, "--no-compile", "--no-cache-dir", "--target", str(staging), *wheels])
    for name in (SGLANG_TAR, MEGATRON_TAR):
        with tarfile.open(bundle / name) as t:
            t.extractall(staging, filter="data")
    digest = hashlib.sha256((bundle / MANIFEST).read_bytes()).hexdigest()
    (staging / INSTALLED).write_text(f"{digest}\n")
    _replace(target, staging)
    pythonpath = f"{target}{os.pathsep}{root / 'integration'}"
    print(f"{target}: {len(wheels)} wheels, sglang, megatron\nexport PYTHONPATH={pythonpath}")
    gpu_wheels.check_imports(pythonpath=pythonpath)
    return pythonpath


def build_loop(wheels: Path, out: Path, *, limit: int = LIMIT) -> dict:
    """gpu-host-loop.txt's wheels from the download's parts in `wheels`, re-cut into parts of at
    most `limit` bytes in `out` (part-NN/, each with the manifest)."""
    chosen = _listed(wheels, parts.items(parts.load_manifest(wheels)), read_lean(LOOP))
    found = parts.verify(wheels, chosen)  # sha256, before any work
    _replaceable(out, parts.MANIFEST)
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    whole = staging / "whole"
    files = [(parts.joined(found[i.file], whole / i.file), i.name, i.version, None)
             for i in chosen]  # fmt: skip
    manifest = parts.bundle(files, staging, cap=limit, inputs=sha256_of(LOOP))
    shutil.rmtree(whole)
    _replace(out, staging, parts.MANIFEST)
    print(parts.summary(manifest))
    return manifest


def install_loop(bundle: Path, target: Path, lean: Path | None = None) -> None:
    """Check every part of the loop bundle (all must be here), join Ray's pieces, `pip install
    --target` the wheels, and import ray and torch_memory_saver with it on the path, after the
    lean bundle's folder `lean`: Ray's requirements that the lean list carries (jsonschema
    among them) are left out of the loop list and come from there."""
    if lean is not None and not lean.is_dir():
        raise UpstreamError(f"the lean bundle's folder {lean} is not here: install it first "
                            "(`gpu_lean install`), or name it with --lean")  # fmt: skip
    manifest = parts.load_manifest(bundle)
    missing = [k for k in range(1, manifest["parts"] + 1) if not parts.part_dir(bundle, k).is_dir()]
    if missing:
        raise UpstreamError(f"parts {missing} of {manifest['parts']} are not in {bundle}; "
                            "carry each part-NN/ (a warm host keeps the earlier ones)")  # fmt: skip
    found = parts.verify(bundle, parts.items(manifest))  # every sha256 before anything is written
    paths = [str(parts.joined(ps, bundle / "joined" / f)) for f, ps in found.items()]
    _replaceable(target)
    staging = target.parent / f".{target.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--target", str(staging)]  # fmt: skip
    gpu_wheels._run([*pip, *paths])
    (staging / INSTALLED).write_text(f"{manifest['inputs']}\n")
    _replace(target, staging)
    shutil.rmtree(bundle / "joined", ignore_errors=True)
    print(f"{target}: {len(paths)} wheels; add it to PYTHONPATH after the lean bundle's folder")
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), lean and str(lean),
                                       str(target)) if p)  # fmt: skip
    code = "import ray, torch_memory_saver; print('imported ray', ray.__version__)"
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    print(done.stdout, end="")
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no error output)"])[-1]
        raise UpstreamError(f"ray or torch_memory_saver does not import with PYTHONPATH={path}: "
                            f"{last}; the loop's parts leave out what the lean bundle carries, "
                            "so its folder must be on the path (--lean)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onpolicy.upstream.gpu_lean",
                                 description=__doc__.splitlines()[0])  # fmt: skip
    ap.add_argument("--root", type=Path, default=None, help="repo root (default: search upward)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="networked machine: the one-call bundle from the parts")
    p.add_argument("--wheels", type=Path, default=None, help="default: build/wheels-cp312")
    p.add_argument("--out", type=Path, default=None, help="default: build/gpu-lean")
    p = sub.add_parser("install", help="GPU host: check the lean bundle, install, import")
    p.add_argument("--bundle", type=Path, default=None, help="default: build/gpu-lean")
    p.add_argument("--target", type=Path, default=None, help="default: build/gpu-site")
    p = sub.add_parser("build-loop", help="networked machine: the GRPO loop's parts")
    p.add_argument("--wheels", type=Path, default=None, help="default: build/wheels-cp312")
    p.add_argument("--out", type=Path, default=None, help="default: build/gpu-loop")
    p = sub.add_parser("install-loop", help="GPU host: check the loop's parts, install, import")
    p.add_argument("--bundle", type=Path, default=None, help="default: build/gpu-loop")
    p.add_argument("--target", type=Path, default=None, help="default: build/gpu-site-loop")
    p.add_argument(
        "--lean",
        type=Path,
        default=None,
        help="the lean bundle's folder (default: build/gpu-site where it exists)",
    )
    args = ap.parse_args(argv)
    try:
        root = args.root.resolve() if args.root else find_root()
        if args.cmd == "build":
            wheels = (args.wheels or root / "build" / "wheels-cp312").resolve()
            build(root, wheels, (args.out or root / "build" / "gpu-lean").resolve())
        elif args.cmd == "build-loop":
            wheels = (args.wheels or root / "build" / "wheels-cp312").resolve()
            build_loop(wheels, (args.out or root / "build" / "gpu-loop").resolve())
        elif args.cmd == "install-loop":
            bundle = (args.bundle or root / "build" / "gpu-loop").resolve()
            lean = args.lean or root / "build" / "gpu-site"
            lean = lean.resolve() if args.lean or lean.is_dir() else None
            install_loop(bundle, (args.target or root / "build" / "gpu-site-loop").resolve(), lean)
        else:
            bundle = (args.bundle or root / "build" / "gpu-lean").resolve()
            install(root, bundle, (args.target or root / "build" / "gpu-site").resolve())
    except UpstreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
