"""acshim's CPU tensor allocator (``acshim.host_allocator``, ``csrc/host_cache.cpp``): torch's CPU
allocator under ``acshim run --budget``, keeping freed blocks once the plan runs, never mapping more
than its tensors held at most since it was last emptied.

The allocator is process-wide, so each scenario runs in its own process: what it measures
(``VmHWM`` above a baseline) is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from acshim import host_allocator

REPOSITORY = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")


PROLOGUE = """
import json, os, torch
from acshim import host_allocator
torch.set_num_threads(1)
def status(name):
    for line in open("/proc/self/status"):
        if line.startswith(name):
            return int(line.split()[1]) * 1024
def reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
"""


def _run(body: str, **env: str) -> dict:
    """Run ``PROLOGUE`` and ``body`` in a fresh process; its ``RESULT`` line, parsed."""
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run([sys.executable, "-c", PROLOGUE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=600, env=environment, cwd=REPOSITORY)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])




def test_training_with_the_cache_is_bitwise_and_holds_no_more_than_a_mapping_per_tensor() -> None:
    """A Hugging Face GPT-2 loop (dropout on, AdamW, torch's recompute) after a warm-up step: four
    steps with a mapping per tensor, then four with the cache, in one process from one baseline. The
    cache serves most of its steps' blocks, the whole-run high-water mark is no higher than with a
    mapping per tensor (within a page per block rounding: 1 MiB), and the weights equal a run on
    torch's own allocator bitwise."""
    script = """
    import transformers
    def train(steps_plain, steps_cached, allocator):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=2, n_positions=128, vocab_size=512,
                                         bos_token_id=0, eos_token_id=1)
        model = transformers.GPT2LMHeadModel(config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(1))
        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        step()
        peaks = {}
        if allocator:
            host_allocator.release()
        reset()
        base = status("VmRSS")
        for phase, steps in (("plain", steps_plain), ("cached", steps_cached)):
            if phase == "cached" and allocator:
                host_allocator.enable_cache()
                before = host_allocator.stats()
            for _ in range(steps):
                step()
            peaks[phase] = status("VmHWM") - base
            reset()
        hits = host_allocator.stats()["hits"] - before["hits"] if allocator else 0
        misses = host_allocator.stats()["misses"] - before["misses"] if allocator else 0
        return [p.detach().clone() for p in model.parameters()], peaks, hits, misses
    reference, _, _, _ = train(4, 4, allocator=False)
    assert host_allocator.install()
    weights, peaks, hits, misses = train(4, 4, allocator=True)
    bitwise = all(torch.equal(a, b) for a, b in zip(reference, weights))
    print("RESULT " + json.dumps({"bitwise": bitwise, "peaks": peaks, "hits": hits, "misses": misses,
                                  "stats": host_allocator.stats()}))
    """
    result = _run(script)
    assert result["bitwise"], result
    assert result["hits"] > 4 * result["misses"], result
    assert result["peaks"]["cached"] <= result["peaks"]["plain"] + 2**20, result


def test_what_is_mapped_never_exceeds_the_most_held_since_the_cache_was_emptied() -> None:
    """Random sizes (64 KiB to 4 MiB) allocated and freed in random order, the cache on: the
    allocator never maps more than its tensors held at most (its own counters, checked after every
    operation), serves repeated sizes from the cache, and ``release`` gives every cached byte back.
    A 16 MiB block written a page per 64 KiB is unmapped when freed, not cached, and raises the
    bound by its written pages only."""
    script = """
    import random
    assert host_allocator.install()
    host_allocator.enable_cache()
    host_allocator.release()
    rng = random.Random(0)
    sizes = [rng.choice((65536, 200000, 1 << 20, 3 << 20, 4 << 20)) for _ in range(64)]
    live, worst, most_held = [], 0, 0
    for size in sizes * 20:
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(torch.ones(size, dtype=torch.uint8))
        stats = host_allocator.stats()
        most_held = max(most_held, stats["allocated"])
        worst = max(worst, stats["mapped"] - most_held)
    cached = host_allocator.cached()
    released = host_allocator.release()
    del live
    host_allocator.release()
    scratch = torch.empty(16 << 20, dtype=torch.uint8)   # written a page per 64 KiB (TRL's log-prob scratch)
    scratch[::65536] = 1
    del scratch
    sparse = host_allocator.stats()
    print("RESULT " + json.dumps({"worst": worst, "cached": cached, "released": released,
                                  "after": host_allocator.cached(), "stats": host_allocator.stats(),
                                  "sparse": sparse}))
    """
    result = _run(script)
    assert result["worst"] <= 0, result
    # a block never written in full is given back, and the bound counts only its written pages
    assert result["sparse"]["cached"] == 0 and result["sparse"]["bound"] <= 256 * 4096, result
    assert result["stats"]["hits"] > result["stats"]["misses"], result
    assert result["released"] == result["cached"] and result["after"] == 0, result


def test_fork_profiler_and_uninstall() -> None:
    """A forked child (a DataLoader worker) allocates and frees through the cache and exits; torch's
    profiler still sees CPU allocations (``profile_memory``); ``uninstall`` gives torch its allocator
    back, and blocks made before it are unmapped when freed."""
    script = """
    assert host_allocator.install()
    host_allocator.enable_cache()
    kept = torch.ones(1 << 20)
    del kept
    parent_cached = host_allocator.cached()
    pid = os.fork()
    if pid == 0:
        fresh = host_allocator.cached() == 0                      # the parent's cache is not the child's
        for _ in range(50):
            x = torch.randn(512, 512)
            del x
        os._exit(0 if fresh and host_allocator.stats()["hits"] > 0 else 3)
    _, code = os.waitpid(pid, 0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = torch.randn(256, 1024)
        z = y * 2
    profiled = max(event.cpu_memory_usage for event in prof.key_averages())
    old = torch.ones(1 << 18)
    host_allocator.uninstall()
    before = host_allocator.stats()
    new = torch.ones(1 << 20)
    del old
    print("RESULT " + json.dumps({"code": code, "parent_cached": parent_cached, "profiled": profiled, "installed": host_allocator.installed(),
                                  "stats_after": before, "equal": bool(torch.equal(new, torch.ones(1 << 20)))}))
    """
    result = _run(script)
    assert result["code"] == 0 and result["parent_cached"] >= 4 << 20, result
    assert result["profiled"] >= 256 * 1024 * 4, result
    assert not result["installed"] and result["stats_after"] == {} and result["equal"], result


def test_turned_off_by_its_variable_leaves_torch_allocator() -> None:
    script = """
    print("RESULT " + json.dumps({"installed": host_allocator.install(), "status": host_allocator.status()}))
    """
    result = _run(script, ACSHIM_HOST_CACHE="0")
    assert result == {"installed": False, "status": "not installed (turned off by ACSHIM_HOST_CACHE=0)"}


def test_not_installed_reads_zero() -> None:
    if host_allocator.installed():
        pytest.skip("installed in this process")
    assert host_allocator.cached() == 0 and host_allocator.release() == 0 and host_allocator.stats() == {}
    assert torch.ones(3).sum().item() == 3
