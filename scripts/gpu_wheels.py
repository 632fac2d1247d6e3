"""The wheels the GPU machine lacks, for bench/gpu_check.py: it reaches no package registry, so they are
downloaded here and travel with the repo (name the folder in the device tool's carry).

    python scripts/gpu_wheels.py bench/wheels | sh    # download datasets, dill, multiprocess, fsspec, transformers,
                                                      # peft and bitsandbytes
    python scripts/gpu_wheels.py --slim bench/wheels  # (the last command of those) cut bitsandbytes to CUDA 13

bench/gpu_check.py installs what is in bench/wheels (git-ignored) into a temporary folder before its parts run.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the GPU machine lacks of what the parts import (the device docs' package list of its image, 2026-11-17),
# at the versions CI runs (constraints.txt). fsspec is there, at a version nobody has read: it travels too,
# since datasets 5.2 wants fsspec<=2026.9.0. transformers and peft are there at older versions (5.17 and 0.21.0 on
# 2026-12-04): CI's travel too, so the GPU runs what CI tests (the image's tokenizers and hub satisfy them).
# bitsandbytes 0.50.2 ships a CUDA 13.0 build (the GPU machine's torch is 2.11.0+cu130).
CARRIED = ("datasets", "dill", "multiprocess", "fsspec", "transformers", "peft")
BITSANDBYTES = "0.50.2"
# bitsandbytes' wheel holds a library for every CUDA, ROCm and XPU version (43 MB): with the repo (about 31 MB)
# it would not fit the device tool's 64 MiB. Only these stay (--slim).
BNB_KEPT = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
GPU_PYTHON = "3.12"


def download_commands(folder: Path) -> str:
    """The commands, run here (where pip reaches PyPI), that fill `folder` with manylinux x86-64 wheels
    for the GPU machine's Python of what it lacks, then cut bitsandbytes' wheel to its CUDA 13 build."""
    pins = constraint_pins()
    wanted = [f"{name}=={pins[name]}" for name in CARRIED] + [f"bitsandbytes=={BITSANDBYTES}"]
    platforms = " ".join(f"--platform {p}" for p in PLATFORMS)
    return "\n".join(
        [
            f"# wheels for the GPU machine (Python {GPU_PYTHON}, x86-64, no registry): fill {folder} here",
            f"python3 -m pip download --no-deps --only-binary=:all: --python-version {GPU_PYTHON} --implementation cp "
            f"{platforms} -d {folder} {' '.join(wanted)}",
            f"python3 scripts/gpu_wheels.py --slim {folder}",
            f"# then name {folder} in the device tool's carry; bench/gpu_check.py installs from bench/wheels when it is there",
        ]
    )


def constraint_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and not line.startswith("#"):
            pins[name.strip().lower()] = version.strip()
    return pins


def slim_wheels(folder: Path) -> list[str]:
    """Rewrite each bitsandbytes wheel in `folder` without the native libraries the GPU machine does not
    load (and their RECORD lines); returns what it did, one line each."""
    done = []
    for wheel in sorted(folder.glob("bitsandbytes-*.whl")):
        before = wheel.stat().st_size
        slimmed = wheel.with_suffix(".slim")
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as dst:
            dropped = {n for n in src.namelist() if n.endswith(".so") and Path(n).name not in BNB_KEPT}
            for item in src.infolist():
                if item.filename in dropped:
                    continue
                data = src.read(item)
                if item.filename.endswith(".dist-info/RECORD"):
                    data = _record_without(data, dropped)
                dst.writestr(item, data)
        os.replace(slimmed, wheel)
        done.append(
            f"{wheel.name}: {before / 2**20:.1f} -> {wheel.stat().st_size / 2**20:.1f} MiB ({len(dropped)} libraries dropped)"
        )
    if not done:
        done.append(f"no bitsandbytes wheel in {folder}: nothing to slim")
    return done


def _record_without(record: bytes, dropped: set[str]) -> bytes:
    rows = [row for row in csv.reader(io.StringIO(record.decode())) if row and row[0] not in dropped]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue().encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="where the wheels go (bench/wheels is where gpu_check looks)")
    parser.add_argument("--slim", action="store_true", help="cut the bitsandbytes wheel in FOLDER to its CUDA 13 build")
    args = parser.parse_args(argv)
    print("\n".join(slim_wheels(args.folder)) if args.slim else download_commands(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
