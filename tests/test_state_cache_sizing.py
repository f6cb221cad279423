"""The GDN snapshot pool sized from memory (issue 49): on a CUDA device the snapshots take state_cache_gb GiB, else
state_cache_fraction of what the KV pool would have taken, and the KV pool the rest; on the CPU (or when num_pages
sizes the pool) snapshot_slots stays as configured. The GPU's free memory is faked here, so this runs on the CPU."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from model.model import Qwen35ForCausalLM
from profiles import bench_serving
from serving import demo, model_runner, server
from serving.config import EngineConfig
from serving.engine import LLMEngine

MiB = 2**20


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM.from_preset("tiny", seed=0)


def test_split_budget_gives_the_snapshots_their_share_and_the_kv_pool_the_rest():
    # 1000 MiB: a tenth (100 MiB) in 3 MiB slots is 33 slots (99 MiB); the 901 MiB left are 450 pages of 2 MiB,
    # one of them the padding's
    pages, slots = model_runner.split_budget(1000 * MiB, page_bytes=2 * MiB, slot_bytes=3 * MiB,
                                             state_cache_fraction=0.1, state_cache_gb=None)
    assert (pages, slots) == (449, 33)
    # state_cache_gb overrides the fraction: 0.5 GiB = 512 MiB is 170 slots (510 MiB); 490 MiB left: 245 pages
    pages, slots = model_runner.split_budget(1000 * MiB, page_bytes=2 * MiB, slot_bytes=3 * MiB,
                                             state_cache_fraction=0.1, state_cache_gb=0.5)
    assert (pages, slots) == (244, 170)
    assert model_runner.split_budget(1000 * MiB, page_bytes=2 * MiB, slot_bytes=3 * MiB, state_cache_fraction=0.0,
                                     state_cache_gb=None) == (499, 0)
    # a budget below zero gives no snapshot slots (and no pages: the caller refuses that)
    pages, slots = model_runner.split_budget(-MiB, page_bytes=2 * MiB, slot_bytes=3 * MiB, state_cache_fraction=0.1,
                                             state_cache_gb=None)
    assert slots == 0 and pages < 1


def fake_card(monkeypatch, free: int, total: int):
    """A CUDA card with `free` of `total` bytes free, and a step that allocates nothing beyond the pools."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(model_runner, "profile_step_peak", lambda *args, **kwargs: 0)


def test_pages_for_memory_sizes_kv_and_snapshots_from_free_memory(model, monkeypatch):
    free, total = 8 * 2**30, 10 * 2**30
    fake_card(monkeypatch, free, total)
    slot, page = model_runner.state_slot_bytes(model), model_runner.kv_page_bytes(model, 16)
    kwargs = dict(utilization=0.9, page_size=16, num_slots=4 + 1, max_model_len=256, max_num_batched_tokens=256,
                  max_num_seqs=4)
    reserve = 512 * MiB + 4 * model.config.vocab_size * 32
    budget = free - 0.1 * total - reserve - 5 * slot
    pages, slots, sizing = model_runner.pages_for_memory(model, state_cache_fraction=0.1, **kwargs)
    assert slots == int(0.1 * budget // slot) > 0
    assert pages == int((budget - slots * slot) // page) - 1
    assert sizing["snapshot_GiB"] == pytest.approx(slots * slot / 2**30)
    # the gb override: exactly as many slots as fit in it, the KV pool larger by what the fraction would have taken
    pages_gb, slots_gb, _ = model_runner.pages_for_memory(model, state_cache_fraction=0.1, state_cache_gb=0.25,
                                                          **kwargs)
    assert slots_gb == int(0.25 * 2**30 // slot) < slots and pages_gb > pages
    # snapshots that leave no room for one sequence's KV are refused, naming the state cache
    with pytest.raises(ValueError, match="state_cache_gb"):
        model_runner.pages_for_memory(model, state_cache_fraction=0.1, state_cache_gb=8.0, **kwargs)


def test_the_cpu_keeps_the_configured_snapshot_slots(model):
    cfg = EngineConfig(num_pages=64, max_num_seqs=8, snapshot_slots=32, gpu_memory_utilization=0.9,
                       state_cache_gb=4.0)
    sized, sizing = LLMEngine._size(model, cfg)  # the model is on the CPU: num_pages and snapshot_slots stay
    assert (sized.num_pages, sized.snapshot_slots, sizing) == (64, 32, None)
    engine = LLMEngine(model, EngineConfig(num_pages=64, max_num_seqs=8, snapshot_slots=32))
    assert "running_slots 8, snapshot_slots 32 (+1 padding" in engine.pool_summary
    assert engine.pools.num_slots == 8 + 32 + 1


def on_a_fake_card(model):
    """model, as LLMEngine._size sees it, with its weights on a CUDA card."""
    weight = SimpleNamespace(device=torch.device("cuda"), element_size=model.lm_head.weight.element_size)
    return SimpleNamespace(config=model.config, cache_config=model.cache_config, tp=model.tp,
                           lm_head=SimpleNamespace(weight=weight))


def test_the_engine_on_a_fake_card_takes_the_sized_snapshot_slots(model, monkeypatch):
    fake_card(monkeypatch, 4 * 2**30, 8 * 2**30)
    base = EngineConfig(max_num_seqs=2, snapshot_slots=32, max_model_len=256, max_num_batched_tokens=256,
                        gpu_memory_utilization=0.9)
    slot = model_runner.state_slot_bytes(model)
    cfg, sizing = LLMEngine._size(on_a_fake_card(model), replace(base, state_cache_gb=0.125))
    assert cfg.snapshot_slots == int(0.125 * 2**30 // slot) != 32 and sizing["snapshot_GiB"] <= 0.125
    cfg_frac, _ = LLMEngine._size(on_a_fake_card(model), base)  # the default fraction, 0.1
    budget = (4 - 0.8) * 2**30 - (512 * MiB + 2 * model.config.vocab_size * 32) - 3 * slot
    assert cfg_frac.snapshot_slots == int(0.1 * budget // slot)
    assert cfg_frac.num_pages == int((budget - cfg_frac.snapshot_slots * slot)
                                     // model_runner.kv_page_bytes(model, 16)) - 1


@pytest.mark.parametrize("fields", [dict(state_cache_fraction=-0.1), dict(state_cache_fraction=1.5),
                                    dict(state_cache_fraction=float("nan")), dict(state_cache_gb=-1.0),
                                    dict(state_cache_gb=float("inf"))])
def test_config_refuses_a_bad_state_cache(fields):
    with pytest.raises(ValueError, match="state_cache"):
        EngineConfig(**fields)


def test_the_flags_parse_on_the_server_the_demo_and_the_bench(model, monkeypatch, tmp_path):
    args = server.parse_args([])
    assert (args.state_cache_fraction, args.state_cache_gb) == (EngineConfig.state_cache_fraction, None) == (0.1, None)
    args = server.parse_args(["--state-cache-fraction", "0.25", "--state-cache-gb", "1.5"])
    assert (args.state_cache_fraction, args.state_cache_gb) == (0.25, 1.5)

    class Built(Exception):
        pass

    def capture(*args, **kwargs):
        raise Built(args, kwargs)
    monkeypatch.setattr(demo, "make_engine", capture)
    with pytest.raises(Built) as built:
        demo.main(["--device", "cpu", "--state-cache-fraction", "0.3", "--state-cache-gb", "2"])
    assert built.value.args[1]["state_cache_fraction"] == 0.3 and built.value.args[1]["state_cache_gb"] == 2.0
    monkeypatch.setattr(bench_serving, "LLMEngine", capture)
    with pytest.raises(Built) as built:
        bench_serving.main(["--device", "cpu", "--state-cache-fraction", "0.2", "--state-cache-gb", "3",
                            "--out-dir", str(tmp_path)], model=model)
    cfg = built.value.args[0][1]
    assert (cfg.state_cache_fraction, cfg.state_cache_gb) == (0.2, 3.0)


@pytest.mark.parametrize("main", [server.main, demo.main, bench_serving.main])
@pytest.mark.parametrize("argv", [["--state-cache-fraction", "0"], ["--state-cache-fraction", "1.5"],
                                  ["--state-cache-gb", "0"], ["--state-cache-gb", "-2"]])
def test_the_flags_refuse_nonsense(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err
