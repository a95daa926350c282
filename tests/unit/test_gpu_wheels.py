"""The offline GPU host's wheel set: the pinned requirement list, the parts and their manifest
(size cap, sha256 refusal before anything is installed) and the unmet-requirement check, on
small fake wheels made here (no network, no pip)."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onpolicy.upstream import gpu_lean, gpu_wheels, parts
from onpolicy.upstream.errors import UpstreamError

FORBIDDEN = re.compile(r"^(torch|triton|nvidia-.*|sgl-kernel|sglang-kernel|flashinfer.*)$")


def fake_files(folder: Path, sizes: dict[str, int]) -> list[tuple[Path, str, str, None]]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (name, size) in enumerate(sorted(sizes.items())):
        path = folder / f"{name}-1.{i}-py3-none-any.whl"
        path.write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
        out.append((path, name, f"1.{i}", None))
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_requirement_list_pins_every_line_and_ships_nothing_the_host_has_or_cannot_install():
    text = gpu_wheels.REQUIREMENTS.read_text()
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    unpinned = [ln for ln in lines if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", ln)]
    assert not unpinned, f"lines not pinned with ==: {unpinned}"
    names = [gpu_wheels.canonical(ln.split("==")[0]) for ln in lines]
    assert not [n for n in names if FORBIDDEN.match(n)], "torch/triton/nvidia-*/kernels shipped"
    reqs = gpu_wheels.read_requirements()
    assert sorted(reqs.pins) == sorted(names), "read_requirements skipped or invented a line"
    for name in ("torch", "triton", "nvidia-*", "sglang-kernel", "flashinfer-python"):
        assert reqs.excluded.get(name), f"no `# exclude {name}: why` line"


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ("numpy", "not pinned"),
        ("numpy>=2.0", "not pinned"),
        ("torch==2.11.0", "must not be shipped"),
        ("nvidia-cublas==13.1.0", "must not be shipped"),
        ("flashinfer_python==0.7.2", "must not be shipped"),
        ("sgl_kernel==0.4.10", "must not be shipped"),
        ("timm==1.0.25", "must not be shipped"),  # excluded in the file itself
        ("numpy==2.3.5\nNumPy==2.3.5", "pinned twice"),
    ],
)
def test_the_requirement_reader_refuses_unpinned_and_unshippable_lines(tmp_path, line, refused):
    path = tmp_path / "reqs.txt"
    path.write_text(f"# exclude timm: vision only\nsix==1.17.0\n{line}\n")
    with pytest.raises(UpstreamError, match=refused):
        gpu_wheels.read_requirements(path)


def test_parts_respect_the_cap_and_a_file_over_it_is_cut_into_parts_of_its_own(tmp_path):
    cap = 1000
    files = fake_files(tmp_path / "in", {"big": 2500, "a": 600, "b": 500, "c": 400, "d": 90})
    manifest = parts.bundle(files, tmp_path / "out", cap=cap)
    folders = sorted((tmp_path / "out").glob("part-*"))
    assert len(folders) == manifest["parts"]
    for folder in folders:
        size = sum(f.stat().st_size for f in folder.iterdir() if f.name != parts.MANIFEST)
        assert size <= cap, f"{folder.name} holds {size} bytes > {cap}"
        assert json.loads((folder / parts.MANIFEST).read_text()) == manifest
    big = next(i for i in parts.items(manifest) if i.name == "big")
    assert [p.size for p in big.pieces] == [1000, 1000, 500]
    for piece in big.pieces:
        alone = [f.name for f in parts.part_dir(tmp_path / "out", piece.part).iterdir()]
        assert sorted(alone) == sorted([piece.file, parts.MANIFEST]), f"{piece} shares its part"
    found = parts.verify(tmp_path / "out", parts.items(manifest))
    for path, *_ in files:
        whole = parts.joined(found[path.name], tmp_path / "joined" / path.name)
        assert whole.read_bytes() == path.read_bytes(), f"{path.name} not rebuilt"
    assert big.file in parts.summary(manifest)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=2000))  # fmt: skip
def test_split_never_exceeds_the_cap_and_places_every_byte_once(sizes, cap):
    named = {f"f{i}": s for i, s in enumerate(sizes)}
    layout = parts.split(named, cap)
    for part in layout:
        assert sum(length for _, _, length in part) <= cap
        assert len(part) == 1 or all(named[f] <= cap for f, _, _ in part), "a piece shares a part"
    for f, size in named.items():
        spans = sorted((start, length) for p in layout for g, start, length in p if g == f)
        assert [s for s, _ in spans] == (list(range(0, size, cap)) if size > cap else [0])
        assert sum(length for _, length in spans) == size


@pytest.mark.parametrize("victim", ["a", "big"])  # a whole wheel, a piece of one over the cap
def test_a_changed_file_is_refused_naming_it_and_both_hashes(tmp_path, victim):
    files = fake_files(tmp_path / "in", {"big": 2500, "a": 600})
    manifest = parts.bundle(files, tmp_path / "out", cap=1000)
    piece = next(i for i in parts.items(manifest) if i.name == victim).pieces[-1]
    path = parts.part_dir(tmp_path / "out", piece.part) / piece.file
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(UpstreamError) as e:
        parts.verify(tmp_path / "out", parts.items(manifest))
    msg = str(e.value)
    assert piece.file in msg and piece.sha256 in msg and sha(path) in msg, msg


def test_the_installer_checks_every_file_before_it_installs_anything(tmp_path, monkeypatch):
    files = fake_files(tmp_path / "in", {"a": 600, "b": 500, "c": 400})
    manifest = parts.bundle(files, tmp_path / "out", cap=1000)
    ran = []
    monkeypatch.setattr(gpu_wheels, "_run", ran.append)
    last = parts.items(manifest)[-1].pieces[0]
    path = parts.part_dir(tmp_path / "out", last.part) / last.file
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(UpstreamError, match="sha256 mismatch"):
        gpu_wheels.install(tmp_path, tmp_path / "out")
    assert ran == [], "pip ran before every file was checked"
    for folder in (tmp_path / "out").glob("part-0[2-9]"):
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    with pytest.raises(UpstreamError, match=r"parts \[2"):
        gpu_wheels.install(tmp_path, tmp_path / "out")
    assert ran == []


def test_parts_of_two_downloads_are_not_mixed(tmp_path):
    parts.bundle(fake_files(tmp_path / "in", {"a": 600, "b": 500}), tmp_path / "out", cap=700)
    other = parts.part_dir(tmp_path / "out", 2) / parts.MANIFEST
    other.write_text(other.read_text().replace('"cap": 700', '"cap": 701'))
    with pytest.raises(UpstreamError, match="differ"):
        parts.load_manifest(tmp_path / "out")


def fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_every_requirement_of_a_shipped_wheel_is_met_reported_or_refused(tmp_path):
    reqs = gpu_wheels.Requirements(pins={}, excluded={"timm": "vision only", "nvidia-*": "cuda"})
    wheels = [
        fake_wheel(tmp_path, "app", "1.0", [
            "lib>=2",  # shipped 1.0: refused
            "gone",  # shipped nowhere: refused
            "torch>=2.10",  # the host's 2.11.0: met
            "torch==2.14.1",  # the host's 2.11.0: reported
            "timm",  # excluded: reported
            "nvidia-cublas",  # excluded by pattern: reported
            'old; python_version < "3.12"',  # not on the host's Python: ignored
            "web[http]",  # asks for web's http extra
        ]),
        fake_wheel(tmp_path, "lib", "1.0", []),
        fake_wheel(tmp_path, "web", "3.0", ['h2; extra == "http"', 'h3; extra == "quic"']),
    ]  # fmt: skip
    problems, notes = gpu_wheels.unmet(wheels, reqs, host={"torch": "2.11.0+cu130"})
    assert sorted(problems) == sorted([
        "app 1.0 needs lib>=2; shipped: lib 1.0",
        "app 1.0 needs gone: not shipped, not on the host, not excluded",
        "web 3.0 needs h2; extra == \"http\": not shipped, not on the host, not excluded",
    ]), problems  # fmt: skip
    assert sorted(notes) == sorted([
        "app needs nvidia-cublas: not shipped (cuda)",
        "app needs timm: not shipped (vision only)",
        "app needs torch==2.14.1; the host has torch 2.11.0+cu130",
    ]), notes  # fmt: skip


# The lean bundle (gpu_lean.py): one folder under the call limit, installed with pip --target.


def test_the_lean_list_pins_each_package_as_the_requirement_list_does():
    pins = gpu_wheels.read_requirements().pins
    text = gpu_lean.LEAN.read_text()
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    listed = [ln.split("==") for ln in lines if ln]
    assert len(listed) >= 60, f"only {len(listed)} lines read"
    differ = [f"{n}=={v} (requirements: {pins.get(gpu_wheels.canonical(n))})"
              for n, v in listed if pins.get(gpu_wheels.canonical(n)) != v]  # fmt: skip
    assert not differ, differ
    lean = gpu_lean.read_lean()
    assert sorted(lean) == sorted(gpu_wheels.canonical(n) for n, _ in listed)
    for needed in ("transformers", "ipython", "xgrammar", "pydantic", "pyzmq"):
        assert needed in lean, f"{needed} left out of the lean list"
    for unneeded in ("ray", "wandb", "torch", "triton", "mistral-common"):
        assert unneeded not in lean, f"{unneeded} is in the lean list"


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ("six==1.16.0", "but gpu-host-requirements.txt pins 1.17.0"),
        ("numpy==2.3.5", "does not pin it"),
        ("six>=1.0", "not pinned"),
        ("six==1.17.0\nSix==1.17.0", "listed twice"),
    ],
)
def test_the_lean_reader_refuses_a_pin_that_differs_from_the_requirements(tmp_path, line, refused):
    path = tmp_path / "lean.txt"
    path.write_text(f"# why\nidna==3.11\n{line}\n")
    with pytest.raises(UpstreamError, match=refused):
        gpu_lean.read_lean(path, pins={"six": "1.17.0", "idna": "3.11"})


def sglang_wheel(path: Path) -> dict[str, bytes]:
    files = {
        "sglang/__init__.py": b"x = 1\n",
        "sglang/utils.py": b"import IPython\n",
        "sglang/srt/rust_extensions/__init__.py": b"",
        "sglang/srt/rust_extensions/loader.py": b"# loads by name\n",
        **{f"sglang/srt/rust_extensions/{m}.cpython-312-x86_64-linux-gnu.so": m.encode() * 50
           for m in ("_bench", "_grpc", "_multimodal", "_server")},
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": b"\x7fELF",
        "sglang/srt/mem_cache/rust_tree_core/__init__.py": b"",
        "sglang/test/test_utils.py": b"",
        "sglang/test/a/b.py": b"",
        "sglang/benchmark/bench.py": b"",
        "sglang/multimodal_gen/test/unit/t.py": b"",  # not sglang/test: kept
        "sglang/srt/testing_tools.py": b"",  # a name starting like a dropped one: kept
    }  # fmt: skip
    rows = [f"{n},sha256=x,{len(d)}" for n, d in files.items()] + ["sglang-0.1.dist-info/RECORD,,"]
    files["sglang-0.1.dist-info/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return files


def test_the_sglang_tarball_drops_exactly_the_unloaded_rust_extensions_tests_and_benchmarks(
    tmp_path,
):
    files = sglang_wheel(tmp_path / "sglang-0.1-cp312-cp312-linux_x86_64.whl")
    gone = gpu_lean.pack_sglang(tmp_path / "sglang-0.1-cp312-cp312-linux_x86_64.whl",
                                tmp_path / "s.tar.xz")  # fmt: skip
    expected_gone = {
        *(f"sglang/srt/rust_extensions/{m}.cpython-312-x86_64-linux-gnu.so"
          for m in ("_bench", "_grpc", "_multimodal", "_server")),
        "sglang/test/test_utils.py", "sglang/test/a/b.py", "sglang/benchmark/bench.py",
    }  # fmt: skip
    assert set(gone) == expected_gone
    with tarfile.open(tmp_path / "s.tar.xz") as t:
        members = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    assert set(members) == set(files) - expected_gone
    for name in set(members) - {"sglang-0.1.dist-info/RECORD"}:
        assert members[name] == files[name], f"{name} changed in the tarball"
    record = members["sglang-0.1.dist-info/RECORD"].decode()
    rows = {r.split(",")[0] for r in record.splitlines()}
    assert rows == set(members), "RECORD does not list exactly the files kept"
    again = tmp_path / "again.tar.xz"
    gpu_lean.pack_sglang(tmp_path / "sglang-0.1-cp312-cp312-linux_x86_64.whl", again)
    assert sha(again) == sha(tmp_path / "s.tar.xz"), "packing is not reproducible"


def lean_bundle(tmp_path: Path, *, limit: int = gpu_lean.LIMIT) -> tuple[Path, dict]:
    staging = tmp_path / "staging"
    fake_files(staging / "wheels", {"alpha": 3000, "beta": 2000})
    sglang_wheel(tmp_path / "sglang.whl")
    gpu_lean.pack_sglang(tmp_path / "sglang.whl", staging / gpu_lean.SGLANG_TAR)
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "__init__.py").write_text("x = 1\n")
    (tmp_path / "megatron" / "core" / "__pycache__").mkdir()
    (tmp_path / "megatron" / "core" / "__pycache__" / "x.pyc").write_bytes(b"stale")
    assert gpu_lean.pack_tree(tmp_path / "megatron", staging / gpu_lean.MEGATRON_TAR) == 1
    return tmp_path / "bundle", gpu_lean.seal(staging, tmp_path / "bundle", limit=limit)


def test_a_lean_bundle_over_the_limit_is_refused_naming_the_rule_and_both_sizes(tmp_path):
    bundle, sealed = lean_bundle(tmp_path / "fits")
    total = sealed["total"]
    assert total == sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert sealed["limit"] == 60 << 20, "the limit is not 64 MiB less the 4 MiB margin"
    with pytest.raises(UpstreamError) as e:
        lean_bundle(tmp_path / "over", limit=total - 1)
    msg = str(e.value)
    assert f"{total:,} bytes" in msg and f"{total - 1:,} bytes" in msg, msg
    assert "64 MiB" in msg and "working tree" in msg, msg
    assert not (tmp_path / "over" / "bundle").exists(), "a refused bundle was left in place"
    assert not (tmp_path / "over" / "staging").exists(), "the refused staging folder was kept"


def test_install_lean_refuses_a_corrupted_file_naming_it_before_installing(tmp_path, monkeypatch):
    bundle, sealed = lean_bundle(tmp_path)
    ran = []
    monkeypatch.setattr(gpu_wheels, "_run", ran.append)
    monkeypatch.setattr(gpu_wheels, "check_imports", lambda **kw: ran.append(kw))
    victim = bundle / next(f["file"] for f in sealed["files"] if "beta" in f["file"])
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(UpstreamError) as e:
        gpu_lean.install(tmp_path, bundle, tmp_path / "site")
    assert victim.name in str(e.value) and "sha256 mismatch" in str(e.value), str(e.value)
    assert ran == [] and not (tmp_path / "site").exists(), "installed before every file checked"
    (bundle / gpu_lean.MEGATRON_TAR).unlink()
    victim.write_bytes(bytes(data[:100]) + bytes([data[100] ^ 1]) + bytes(data[101:]))
    with pytest.raises(UpstreamError, match=gpu_lean.MEGATRON_TAR + " is missing"):
        gpu_lean.install(tmp_path, bundle, tmp_path / "site")
    assert ran == []


def test_install_lean_fills_the_target_from_the_checked_bundle(tmp_path, monkeypatch):
    bundle, _ = lean_bundle(tmp_path)
    ran: list = []
    monkeypatch.setattr(gpu_wheels, "_run", lambda cmd: ran.append(cmd))
    monkeypatch.setattr(gpu_wheels, "check_imports", lambda **kw: ran.append(kw))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mine.txt").write_text("not the tool's")
    with pytest.raises(UpstreamError, match="did not write"):
        gpu_lean.install(tmp_path, bundle, tmp_path / "site")
    assert ran == [], "pip ran before the target was found not replaceable"
    (tmp_path / "site" / "mine.txt").unlink()
    path = gpu_lean.install(tmp_path, bundle, tmp_path / "site")
    pip, imports = ran
    assert pip[pip.index("--target") + 1] == str(tmp_path / ".site.staging")
    assert sorted(Path(w).name for w in pip if w.endswith(".whl")) == sorted(
        f.name for f in (bundle / "wheels").iterdir()
    )
    for flag in ("--no-index", "--no-deps", "--no-compile", "--no-cache-dir"):
        assert flag in pip, f"pip ran without {flag}"
    site = tmp_path / "site"
    assert (site / "sglang" / "srt" / "mem_cache" / "rust_tree_core" / "__init__.py").is_file()
    assert not (site / "sglang" / "test").exists()
    assert (site / "megatron" / "core" / "__init__.py").read_text() == "x = 1\n"
    assert not (site / "megatron" / "core" / "__pycache__").exists()
    assert path == f"{site}:{tmp_path / 'integration'}" and imports == {"pythonpath": path}
    gpu_lean.install(tmp_path, bundle, site)  # a folder it filled itself is replaced
    assert (site / gpu_lean.INSTALLED).is_file()


# The GRPO loop's parts (gpu_lean build-loop / install-loop): Ray and torch-memory-saver.


def test_the_loop_list_pins_ray_torch_memory_saver_and_nothing_the_lean_bundle_carries():
    loop = gpu_lean.read_lean(gpu_lean.LOOP)  # every line equal to its requirements pin
    for needed in ("ray", "torch-memory-saver", "msgpack", "protobuf", "click"):
        assert needed in loop, f"{needed} left out of the loop list"
    both = sorted(set(loop) & set(gpu_lean.read_lean()))
    assert not both, f"in the lean and the loop lists: {both}"
    for unneeded in ("torch", "triton", "wandb", "pyarrow"):
        assert unneeded not in loop, f"{unneeded} is in the loop list"


def test_install_loop_refuses_a_missing_part_or_a_changed_piece_before_pip_runs(
    tmp_path, monkeypatch
):
    files = fake_files(tmp_path / "in", {"ray": 2500, "msgpack": 300})
    manifest = parts.bundle(files, tmp_path / "loop", cap=1000)
    ran = []
    monkeypatch.setattr(gpu_wheels, "_run", ran.append)
    ray = next(i for i in parts.items(manifest) if i.name == "ray")
    assert len(ray.pieces) == 3  # over the cap: cut into pieces, a part each
    last = parts.part_dir(tmp_path / "loop", ray.pieces[-1].part) / ray.pieces[-1].file
    data = bytearray(last.read_bytes())
    data[0] ^= 1
    last.write_bytes(bytes(data))
    with pytest.raises(UpstreamError, match="sha256 mismatch") as e:
        gpu_lean.install_loop(tmp_path / "loop", tmp_path / "site")
    assert last.name in str(e.value), e.value
    for f in last.parent.iterdir():
        f.unlink()
    last.parent.rmdir()
    with pytest.raises(UpstreamError, match=rf"parts \[{ray.pieces[-1].part}\] of"):
        gpu_lean.install_loop(tmp_path / "loop", tmp_path / "site")
    assert ran == [] and not (tmp_path / "site").exists()


def test_install_loop_imports_ray_after_the_lean_folder_and_names_what_is_missing(
    tmp_path, monkeypatch
):
    """Ray imports packages that only the lean bundle carries (jsonschema): the import check
    puts the lean folder on the path, and without it the error names the missing module."""
    files = fake_files(tmp_path / "in", {"ray": 500, "torch-memory-saver": 300})
    parts.bundle(files, tmp_path / "loop", cap=1000)

    def pip(cmd: list[str]) -> None:  # the wheels are stand-ins: write what they would install
        staging = Path(cmd[cmd.index("--target") + 1])
        for package, body in (("ray", "import only_in_lean\n__version__ = '9'\n"),
                              ("torch_memory_saver", "")):  # fmt: skip
            (staging / package).mkdir(parents=True)
            (staging / package / "__init__.py").write_text(body)

    monkeypatch.setattr(gpu_wheels, "_run", pip)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    site, lean = tmp_path / "site", tmp_path / "lean"
    with pytest.raises(UpstreamError, match="is not here") as e:
        gpu_lean.install_loop(tmp_path / "loop", site, lean)
    assert str(lean) in str(e.value) and not site.exists()
    with pytest.raises(UpstreamError, match="No module named 'only_in_lean'") as e:
        gpu_lean.install_loop(tmp_path / "loop", site)
    assert f"PYTHONPATH={site}:" in str(e.value) and "--lean" in str(e.value), e.value
    lean.mkdir()
    (lean / "only_in_lean.py").write_text("")
    gpu_lean.install_loop(tmp_path / "loop", site, lean)
    assert (site / "ray" / "__init__.py").is_file() and (site / gpu_lean.INSTALLED).is_file()
