"""Part 4 of bench/gpu_check.py: 5 steps under recipes/accelerate/fsdp.yaml with a checkpoint after each. The step-5
checkpoint is FSDP's sharded format (on a GPU), the final model loads with plain from_pretrained and equals the
step-5 checkpoint's weights, and a second output_dir holding only the step-3 checkpoint, run with --resume, ends
with the losses of the first run."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from gpu_common import (
    MARKS,
    ROOT,
    STEPS,
    compare,
    load_final,
    load_tensors,
    needs,
    small_config,
    small_recipe,
    write_recipe,
)

pytestmark = MARKS


def test_fsdp(part):
    needs("datasets", "accelerate")
    work, smoke = part.work, part.smoke
    config = work / "config" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(small_config(), indent=1))
    first, second = work / "run", work / "resumed"
    recipe = write_recipe(work / "recipe.yaml", small_recipe(config, first, smoke))
    launch(recipe, [])
    kind, trained = checkpoint_weights(first / "checkpoints" / f"step-{STEPS:08d}", work / "dcp.pt")
    final, loading = load_final(first)
    part.result = result = {
        "checkpoint_format": kind,
        "loading_problems": loading,
        "final_vs_trained": compare(final, trained),
        "final_vs_step1": compare(
            final, checkpoint_weights(first / "checkpoints" / "step-00000001", work / "dcp1.pt")[1]
        ),
    }
    shutil.copytree(first / "checkpoints" / "step-00000003", second / "checkpoints" / "step-00000003")
    launch(recipe, ["--resume", f"output_dir={second}"])
    resumed, _ = load_final(second)
    losses = {name: {m["step"]: m["loss"] for m in metrics(run) if "loss" in m} for name, run in (("a", first), ("b", second))}  # fmt: skip
    result["resumed_vs_uninterrupted"] = compare(resumed, final)
    result["loss_steps_4_5"] = {
        "uninterrupted": [losses["a"][s] for s in (4, 5)],
        "resumed": [losses["b"][s] for s in (4, 5)],
    }
    assert smoke or kind == "fsdp-sharded", f"the step-{STEPS} checkpoint is {kind}: FSDP was not used"
    assert not any(loading.values()), f"from_pretrained reported {loading}"
    assert result["final_vs_trained"]["equal"], "the final checkpoint is not the trained weights"
    assert not result["final_vs_step1"]["equal"], "the final weights equal the step-1 checkpoint's: nothing trained"
    resumed_losses, uninterrupted = result["loss_steps_4_5"]["resumed"], result["loss_steps_4_5"]["uninterrupted"]
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(uninterrupted, resumed_losses)), result["loss_steps_4_5"]


def launch(recipe: Path, args: list[str]) -> None:
    with socket.socket() as sock:  # a free port for the launcher's process group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "recipes/accelerate/fsdp.yaml"), "--num_processes", "1", "--main_process_port", port,
               "-m", "mha2gqa.uptrain", "--recipe", str(recipe), *args]  # fmt: skip
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def checkpoint_weights(checkpoint: Path, scratch: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """The model weights of an accelerate save_state folder: FSDP's sharded torch.distributed.checkpoint
    folder (gathered into one file with DCP's own converter), or a plain model.safetensors."""
    sharded = sorted(checkpoint.glob("pytorch_model_fsdp_*"))
    if sharded:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(sharded[0], scratch)
        state = torch.load(scratch, map_location="cpu", weights_only=True)
        return "fsdp-sharded", state.get("model", state)
    if any(checkpoint.glob("model*.safetensors")):
        return "safetensors", load_tensors(checkpoint)
    raise AssertionError(f"{checkpoint} holds no model weights: {sorted(p.name for p in checkpoint.iterdir())}")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
