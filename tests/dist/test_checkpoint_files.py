"""autopar.save_checkpoint never overwrites the checkpoint a restart would load: numbered
directories, ``latest`` written last, the last ``keep`` kept, and a save that died half
way (a numbered directory without DCP's metadata, ``latest`` still on the one before) is
not what ``load_checkpoint`` reads."""

from __future__ import annotations

import torch

from tests.dist.harness import run_fn_cases


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, 256, (8, 32), generator=g)
    return t, torch.roll(t, -1, dims=1)


def run(case: dict) -> dict:
    """Every rank: three saves with keep=2, then loads."""
    from pathlib import Path

    import gpt
    import torch.distributed as dist

    import autopar

    ckpt = Path(case["dir"]) / "ckpt"
    model, _ = gpt.build(layers=1, dim=64, heads=4, seq=32, batch=8)
    pm = autopar.auto_parallel(model, example_inputs=_batch(), mesh=(2,), zero_stage=1)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    out: dict = {"first_start": autopar.load_checkpoint(pm, opt, ckpt)}
    for step in (1, 2, 3):
        pm(*_batch()).backward()
        opt.step()
        opt.zero_grad()
        autopar.save_checkpoint(pm, opt, ckpt, step=step)
    dist.barrier()
    out["dirs"] = sorted(p.name for p in ckpt.iterdir())
    out["latest"] = (ckpt / "latest").read_text().strip()
    # a save that died half way: its directory has shards but no metadata
    if dist.get_rank() == 0:
        (ckpt / "000004").mkdir()
        (ckpt / "000004" / "__0_0.distcp").write_bytes(b"half a file")
    dist.barrier()
    out["loaded"] = autopar.load_checkpoint(pm, opt, ckpt)
    pm.shutdown()
    return out


def test_saves_are_numbered_and_latest_is_written_last(tmp_path) -> None:
    got = run_fn_cases(2, "tests.dist.test_checkpoint_files:run", [{"id": "c", "dir": str(tmp_path)}])["c"]
    assert "error" not in got, got.get("error")
    assert got["first_start"] is None
    assert got["dirs"] == ["000002", "000003", "latest"] and got["latest"] == "3"
    assert got["loaded"] == {"step": 3}
