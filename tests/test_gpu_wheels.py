"""scripts/gpu_wheels.py: the commands that fill bench/wheels with what the GPU machine lacks, and the cut of
bitsandbytes' wheel to the libraries that machine loads (bench/gpu_check.py installs them there)."""

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_wheels  # noqa: E402


def test_wheel_commands_name_what_the_gpu_machine_lacks(capsys):
    assert gpu_wheels.main(["bench/wheels"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 2
    download = lines[0].split()
    assert download[:4] == ["python3", "-m", "pip", "download"]
    assert "--no-deps" in download and download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("-d") + 1] == "bench/wheels"
    assert {p for i, p in enumerate(download) if download[i - 1] == "--platform"} >= {"manylinux_2_28_x86_64"}
    pins = dict(arg.split("==") for arg in download if "==" in arg)
    constraints = gpu_wheels.constraint_pins()
    carried = ("datasets", "dill", "multiprocess", "fsspec", "transformers", "peft")  # at CI's versions
    assert set(pins) == {*carried, "bitsandbytes"}
    assert all(pins[name] == constraints[name] for name in carried)
    assert lines[1] == "python3 scripts/gpu_wheels.py --slim bench/wheels"


def test_slimming_keeps_the_cuda13_library_and_a_matching_record(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    names = [
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/libbitsandbytes_cuda118.so",
    ]
    record = "".join(f"{n},sha256=x,1\n" for n in names) + "bitsandbytes-0.50.2.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, b"x" * 1000)
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record)
    (line,) = gpu_wheels.slim_wheels(tmp_path)
    assert line.startswith(wheel.name) and line.endswith("(1 libraries dropped)")
    with zipfile.ZipFile(wheel) as z:
        assert "bitsandbytes/libbitsandbytes_cuda118.so" not in z.namelist()
        assert "bitsandbytes/libbitsandbytes_cuda130.so" in z.namelist()
        rows = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()
    assert [r.split(",")[0] for r in rows] == [names[0], names[1], "bitsandbytes-0.50.2.dist-info/RECORD"]
