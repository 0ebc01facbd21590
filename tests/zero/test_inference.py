"""Offloaded inference (tierstore.zero.offload_for_inference): forward and greedy generate equal to the model in
memory bit for bit in fp32 (GPT-2 and Llama from configs; host and nvme; built plainly, under zero.Init, with
from_pretrained under Init, or from a safetensors checkpoint onto meta parameters); a damaged weight file
raises the store's CorruptionError naming the parameters; the weights materialised at once stay within the
budget on a model several times the budget, and so does the process's resident memory while such a model is
built under zero.Init, offloaded and generated from. See [Note: inference over the ZeRO-3 hooks] in
tierstore/zero/inference/offload.py."""
from __future__ import annotations

import copy
import os
import pathlib

import pytest
import torch
import torch.nn as nn

from tests.support import Deep, cfg, peak_growth, rss_follows_live_memory, run_isolated
from tierstore.errors import CorruptionError, MisuseError, TierstoreValueError
from tierstore.zero import Init, offload_for_inference

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers.logging.set_verbosity_error()


def _gpt2(width=32):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_head=2, n_embd=width, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=1))


def _llama(width=32):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, bos_token_id=0, eos_token_id=1))


IDS = torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(1))


def _reference(model):
    with torch.no_grad():
        logits = model(IDS).logits.clone()
        tokens = model.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
    return logits, tokens


def _budget(model) -> int:
    return 2 * sum(p.numel() * 4 for p in model.parameters()) // 3  # less than the model: it must be paged


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("under_init", [False, True], ids=["plain", "init"])
@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_forward_and_generate_equal_the_model_in_memory(tmp_path, build, under_init, tier):
    torch.manual_seed(0)
    ref = build().eval()
    logits, tokens = _reference(ref)
    torch.manual_seed(0)
    if under_init:
        with Init(cfg(tmp_path / "i", params=tier)):
            m = build().eval()
    else:
        m = copy.deepcopy(ref)
    with offload_for_inference(m, tier=tier, nvme_path=tmp_path / "w", budget_bytes=_budget(ref)) as off:
        assert all(p.data.numel() == 0 for p in m.parameters())  # the values are the store's
        with torch.no_grad():
            assert torch.equal(m(IDS).logits, logits)
        with torch.inference_mode():
            assert torch.equal(m(IDS).logits, logits)
        out = m(IDS).logits  # grad mode on: nothing is recorded for a backward
        assert torch.equal(out, logits) and not out.requires_grad
        assert torch.equal(m.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0), tokens)
        st = off.stats()
        assert st.forwards == 3 + 8
        if tier == "nvme":  # read ahead of the modules that used them
            assert st.prefetch_hits > 0 and st.fetches >= 11 and 0 < st.peak_resident_bytes <= _budget(ref)
        else:  # the store lends its own host copies: nothing read, nothing more resident
            assert st.fetches == 0 and st.peak_resident_bytes == 0
        assert all(p.data.numel() == 0 for p in m.parameters())  # released after each forward
    assert not os.listdir(tmp_path / "w") if tier == "nvme" else True  # close() removed the weight files
    with pytest.raises(MisuseError, match="offload for inference that was closed"), torch.no_grad():
        m(IDS)  # the parameters are empty: a clear error, not a shape error deep in the forward


def test_from_pretrained_under_init_then_checkpoint_onto_meta_parameters(tmp_path):
    torch.manual_seed(0)
    ref = _gpt2()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))  # values no initialisation gives: they must come from the file
    ref.save_pretrained(str(tmp_path / "saved"))
    ref = type(ref).from_pretrained(str(tmp_path / "saved")).eval()
    logits, tokens = _reference(ref)
    with Init(cfg(tmp_path / "i", params="nvme")):
        m = type(ref).from_pretrained(str(tmp_path / "saved")).eval()
    with offload_for_inference(m, nvme_path=tmp_path / "w", budget_bytes=_budget(ref)):
        with torch.no_grad():
            assert torch.equal(m(IDS).logits, logits)
        assert torch.equal(m.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0), tokens)
    # parameters on the meta device (buffers real), values from the safetensors file one tensor at a time
    from accelerate import init_empty_weights
    with init_empty_weights():
        m2 = type(ref)(ref.config).eval()
    m2.tie_weights()  # as from_pretrained does: the file holds the tied weight once
    assert all(p.is_meta for p in m2.parameters())
    with offload_for_inference(m2, nvme_path=tmp_path / "w", budget_bytes=_budget(ref),
                               checkpoint=tmp_path / "saved") as off:
        assert m2.lm_head.weight is m2.transformer.wte.weight  # still tied
        with torch.no_grad():
            assert torch.equal(m2(IDS).logits, logits)
        assert torch.equal(m2.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0), tokens)
        off.close(restore=True)
    assert not any(p.is_meta for p in m2.parameters())
    with torch.no_grad():
        assert torch.equal(m2(IDS).logits, logits)  # restored: an ordinary model again


def test_meta_parameters_without_checkpoint_and_small_budgets_are_refused(tmp_path):
    from accelerate import init_empty_weights
    with init_empty_weights():
        m = _gpt2()
    with pytest.raises(TierstoreValueError, match="checkpoint="):
        offload_for_inference(m, nvme_path=tmp_path)
    m = _gpt2()
    with pytest.raises(TierstoreValueError, match=r"budget_bytes=1000 .* pass budget_bytes >= \d+"):
        offload_for_inference(m, nvme_path=tmp_path, budget_bytes=1000)
    with pytest.raises(TierstoreValueError, match="tier="):
        offload_for_inference(m, tier="disk", nvme_path=tmp_path)
    with pytest.raises(TierstoreValueError, match="weights_dtype="):
        offload_for_inference(m, nvme_path=tmp_path, weights_dtype=torch.int8)
    with pytest.raises(TierstoreValueError, match="weights_dtype='int8' with tier='host'"):
        offload_for_inference(m, tier="host", weights_dtype="int8")
    with pytest.raises(TierstoreValueError, match="nvme_path="):
        offload_for_inference(m)
    assert all(p.data.numel() > 0 for p in m.parameters())  # refused before anything was taken


def test_a_model_built_under_init_without_offload_or_optimizer_is_refused(tmp_path):
    with Init(cfg(tmp_path / "i", params="host")):
        m = _gpt2().eval()
    with pytest.raises(MisuseError, match="Zero3Optimizer.*offload_for_inference"), torch.no_grad():
        m(IDS)
    with offload_for_inference(m, tier="host", budget_bytes=_budget(m)):
        with torch.no_grad():
            m(IDS)  # taken by the offload: runs


def test_damaged_weight_file_raises_corruption_naming_the_parameters(tmp_path):
    torch.manual_seed(0)
    m = _llama().eval()
    with offload_for_inference(m, nvme_path=tmp_path / "w", budget_bytes=_budget(m)) as off:
        with torch.no_grad():
            m(IDS)
        files = [os.path.join(r, f) for r, _d, fs in os.walk(tmp_path / "w") for f in fs if f.startswith("extent")]
        # private: the offload's scratch directory is not part of its API
        assert files, os.listdir(off._dir)
        for path in files:  # flip one byte in every written block of every extent file
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                for at in range(100, size, 1 << 20):
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CorruptionError, match=r"stored weights of \['model\.") as e:
            m.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert e.value.filename is not None


def _deep_peak(root: str) -> dict:
    """In a fresh process: peak RSS growth over a forward of Deep() (12 x 1 MiB layers here) offloaded to
    nvme with a 3 MiB budget, after a warm-up forward; and the offload's own count of resident weights."""
    rss_follows_live_memory()
    torch.manual_seed(0)
    m = Deep(layers=12, width=512)
    x = torch.randn(4, 512)
    with torch.no_grad():
        ref = m(x)
    off = offload_for_inference(m, nvme_path=pathlib.Path(root) / "w", budget_bytes=3 << 20)
    with torch.no_grad():
        m(x)  # warm-up: the trace is recorded, the engine's threads and pinned buffers exist
        off.reset_peak()
        grown, out = peak_growth(lambda: m(x))
    st = off.stats()
    off.close()
    return {"grown": grown, "equal": bool(torch.equal(out, ref)), "peak": st.peak_resident_bytes,
            "weights": st.weight_bytes, "hits": st.prefetch_hits}


def test_weights_resident_stay_within_the_budget_on_a_model_four_times_larger(tmp_path):
    r = run_isolated(_deep_peak, str(tmp_path), timeout=120)
    budget = 3 << 20
    print(f"Deep 12 x 1 MiB offloaded with a 3 MiB budget: peak resident weights {r['peak'] / 2**20:.2f} MiB, "
          f"peak RSS growth over a forward {r['grown'] / 2**20:.2f} MiB")
    assert r["equal"] and r["hits"] > 0
    assert r["weights"] >= 4 * budget
    assert 0 < r["peak"] <= budget
    assert r["grown"] <= budget + (1 << 20), r["grown"]  # the budget, plus activations and allocator slack


def _idle_after_forwards(root: str) -> dict:
    """In a fresh process: the result memory kept idle, with Deep() (12 x 1 MiB layers) offloaded to nvme with a
    3 MiB budget, after two forwards and after 8 MiB of results come and go at once; then the same after the
    offload is closed."""
    from tierstore.tiers.host import RESULTS, result_empty

    def burst() -> int:
        held = [result_empty(1 << 20) for _ in range(8)]  # given back together, as a forward's reads can be
        del held
        return RESULTS.idle()
    torch.manual_seed(0)
    m = Deep(layers=12, width=512)
    x = torch.randn(4, 512)
    off = offload_for_inference(m, nvme_path=pathlib.Path(root) / "w", budget_bytes=3 << 20)
    with torch.no_grad():
        m(x)
        m(x)
    idle_open = burst()
    off.close()
    return {"open": idle_open, "closed": burst(), "weights": off.stats().weight_bytes}


def test_recycled_result_memory_stays_within_the_budget_while_offloaded(tmp_path):
    """[Note: the inference budget]: the memory the weights are read into is recycled, and while the offload is
    open what is kept idle for that is bounded by the budget, not by the process-wide limit (256 MiB)."""
    r = run_isolated(_idle_after_forwards, str(tmp_path), timeout=120)
    assert r["weights"] >= 4 * (3 << 20)
    assert 0 < r["open"] <= 3 << 20, r
    assert r["closed"] >= 8 << 20, r  # the limit is lifted with the offload


def _mapped_during_forwards(root: str) -> dict:
    """In a fresh process: the most result memory mapped at once (lent out + kept idle) over two forwards of Deep()
    (12 x 1 MiB layers) offloaded to nvme with a 3 MiB budget, sampled before every layer runs, and while 2 MiB
    of other results are held after them."""
    from tierstore.tiers.host import RESULTS, result_empty

    torch.manual_seed(0)
    m = Deep(layers=12, width=512)
    x = torch.randn(4, 512)
    most = [0]

    def sample(*_a) -> None:
        most[0] = max(most[0], RESULTS.idle() + RESULTS.lent_bytes)
    off = offload_for_inference(m, nvme_path=pathlib.Path(root) / "w", budget_bytes=3 << 20)
    hooks = [mod.register_forward_pre_hook(sample) for mod in m.modules()]
    with torch.no_grad():
        for _ in range(3):
            m(x)
            sample()
    held = [result_empty(1 << 20) for _ in range(2)]  # another size than the buckets': new mappings
    sample()
    del held
    for h in hooks:
        h.remove()
    off.close()
    return {"most": most[0], "weights": off.stats().weight_bytes}


def test_result_memory_lent_and_idle_together_stay_within_the_budget(tmp_path):
    """[Note: the inference budget]: the pool keeps idle only what the budget leaves beside the result memory
    lent out (the weights held and the reads in flight), so the two together never pass the budget."""
    r = run_isolated(_mapped_during_forwards, str(tmp_path), timeout=120)
    assert r["weights"] >= 4 * (3 << 20)
    assert 2 << 20 <= r["most"] <= (3 << 20) + 3 * 4096, r  # each of <= 3 buckets' mappings rounded up to a page


def test_the_offloads_store_pins_few_buffers_whatever_the_budget(tmp_path):
    """[Note: the inference budget]: buckets are read with O_DIRECT straight into result memory, so the store's
    page-locked staging is two buffers and its engine's bounce buffers (resident once registered) the fewest."""
    from tierstore.zero.inference.offload import STAGING_BYTES, staging_bytes
    m = Deep(layers=4, width=256)
    for budget in (4 << 20, 256 << 20):
        assert staging_bytes(budget) == STAGING_BYTES == 8 << 20
        with offload_for_inference(m if budget == 4 << 20 else Deep(layers=4, width=256), nvme_path=tmp_path,
                                   budget_bytes=budget) as off:
            io = off.store.stats()["io"]
            assert io["pinned_bytes"] == STAGING_BYTES
            assert 0 < io["bounce_bytes"] <= 2 * ((1 << 20) + 4096), io


def test_reads_ahead_run_on_more_threads_than_trainings(tmp_path):
    """[Note: reading ahead by bytes] in hooks/prefetch.py: with room in the budget for many buckets ahead,
    offloaded inference has READ_WORKERS (8) reads in flight at once, more than training's 4."""
    import threading
    import time

    from tierstore.zero.hooks.prefetch import READ_WORKERS as TRAINING_WORKERS
    from tierstore.zero.inference.offload import READ_WORKERS
    assert READ_WORKERS == 8 > TRAINING_WORKERS
    torch.manual_seed(0)
    m = Deep(layers=24, width=256)  # 24 buckets of 257 KiB (a budget of 4 MiB packs 256 KiB at most)
    x = torch.randn(2, 256)
    with torch.no_grad():
        ref = m(x)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=4 << 20) as off:
        with torch.no_grad():
            m(x)  # the trace
        pf = off.coordinator.prefetcher
        fetch, lock, now, most = pf.fetch_shard, threading.Lock(), [0], [0]

        def slow(gid):  # a slow disk: each read takes 20 ms, so what is in flight at once shows
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            try:
                time.sleep(0.02)
                return fetch(gid)
            finally:
                with lock:
                    now[0] -= 1
        pf.fetch_shard = slow
        with torch.no_grad():
            out = m(x)
    assert torch.equal(out, ref)
    assert most[0] == READ_WORKERS, most


def test_each_forward_returns_the_heaps_free_pages(tmp_path, monkeypatch):
    """[Note: the inference budget]: the activations and the KV cache freed in a forward go back to the system
    when it ends (malloc_trim), so the process's RSS does not keep the heap's high-water mark token after
    token."""
    from tierstore.zero import heap
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1))
    torch.manual_seed(0)
    m = _gpt2().eval()
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=_budget(m)) as off:
        m.generate(IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert len(calls) == off.stats().forwards == 3


def test_bench_budget_is_a_quarter_of_the_weights_within_128_mib_and_four_linears():
    from tierstore.bench.inference import default_budget
    mib = 1 << 20
    assert default_budget(1155 * mib, 16 * mib) == 128 * mib  # GPT-2 300M: 24 x 1024
    assert default_budget(200 * mib, 5 * mib) == 50 * mib  # a quarter of the weights
    assert default_budget(40 * mib, 5 * mib) == 20 * mib  # never below four of the largest Linear


def test_backward_reaches_the_inputs_not_the_parameters(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(m)
    x = torch.randn(3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    ref(x2).sum().backward()
    with offload_for_inference(m, tier="nvme", nvme_path=tmp_path, budget_bytes=1 << 20):
        y = m(x)
        y.sum().backward()  # the weights are gathered again for the input's gradient; the parameters get none
        assert torch.equal(x.grad, x2.grad)
        assert all(p.grad is None and not p.requires_grad for p in m.parameters())
    assert all(p.requires_grad for p in m.parameters())  # given back by close()


def test_generation_reads_every_bucket_ahead_within_the_budget(tmp_path):
    """After the first forward recorded the trace, every bucket a generation step uses was read ahead (the
    next module's while the current one ran; the first modules' between forwards), and the weights resident at
    once never passed the budget."""
    torch.manual_seed(0)
    m = _llama().eval()
    ref = copy.deepcopy(m)
    budget = _budget(m) // 2
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=budget) as off:
        with torch.no_grad():
            m(IDS)
        c0 = off.coordinator.stats()
        tokens = m.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0)
        c1 = off.coordinator.stats()
        st = off.stats()
    assert torch.equal(tokens, _reference(ref)[1])
    assert len(off.layout.subgroups) >= 6  # several buckets: the budget is a fraction of the model
    assert c1.trace_rebuilds == c0.trace_rebuilds  # the same modules in the same order every token
    assert c1.gathers - c0.gathers >= 8 * len(off.layout.subgroups)
    assert c1.prefetch_hits - c0.prefetch_hits == c1.gathers - c0.gathers
    assert 0 < st.peak_resident_bytes <= budget


def _rounded(model, dtype):
    """`model` with every weight rounded to `dtype` and back (what bf16 storage with fp32 compute computes)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return out


def test_fewer_bytes_bf16_weights_and_bf16_compute_equal_their_in_memory_twins(tmp_path):
    torch.manual_seed(0)
    ref = _gpt2(width=128).eval()
    m = copy.deepcopy(ref)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=_budget(ref),
                               weights_dtype=torch.bfloat16) as off:
        st = off.stats()
        slack = 4096 * len(off.layout.subgroups)  # bytes: each bucket's extent is a whole number of 4 KiB pages
        assert st.stored_bytes <= st.weight_bytes // 2 + slack  # half the bytes on disk
        twin = _rounded(ref, torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(m(IDS).logits, twin(IDS).logits)
        assert torch.equal(m.generate(IDS, max_new_tokens=8, do_sample=False, pad_token_id=0),
                           _reference(twin)[1])
    m = copy.deepcopy(ref)
    twin = copy.deepcopy(ref).to(torch.bfloat16)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=_budget(ref), compute_dtype=torch.bfloat16):
        with torch.no_grad():
            out = m(IDS).logits
            assert out.dtype == torch.bfloat16 and torch.equal(out, twin(IDS).logits)


def test_int8_weights_quarter_the_bytes_and_keep_the_loss(tmp_path):
    torch.manual_seed(0)
    ref = _llama(width=128).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # weights far from their initial constants (norms at 1.0)
    m = copy.deepcopy(ref)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=_budget(ref), weights_dtype="int8") as off:
        st = off.stats()
        slack = 4096 * len(off.layout.subgroups)  # bytes: each bucket's extent is a whole number of 4 KiB pages
        assert st.stored_bytes <= st.weight_bytes * 0.27 + slack  # codes + block scales
        with torch.no_grad():
            loss8 = m(IDS, labels=IDS).loss
            loss = ref(IDS, labels=IDS).loss
        assert not torch.equal(loss8, loss)  # the weights went through the int8 codes
        assert abs(loss8.item() - loss.item()) <= 0.01 * loss.item()
        assert off.stats().convert_s > 0  # dequantized on the reading threads, timed


def test_stored_weights_come_back_as_the_codec_and_torch_give_them_in_recycled_memory():
    """[Note: converting the weights back] in zero/inference/weight_forms.py: int8 read back and dequantized by
    the native kernel equals the store's int8 codec path; bf16 equals torch's cast; both land in the store's
    recycled (4 KiB-aligned) result memory."""
    from tierstore.zero.inference.weight_forms import int8_codec, stored_form, to_compute
    x = torch.randn((1 << 20) + 300, generator=torch.Generator().manual_seed(0))  # a partial last block
    codec = int8_codec()
    for weights, want in (("int8", torch.from_numpy(codec.decode(codec.encode(x.numpy())).copy())),
                          (torch.bfloat16, x.to(torch.bfloat16).float())):
        stored = stored_form(x, weights)
        got = to_compute(stored, torch.float32, x.numel(), weights)
        assert got.dtype == torch.float32 and torch.equal(got, want.view(-1))
        assert got.data_ptr() % 4096 == 0  # the result pool's mapping, faulted in once and reused
    fp32 = stored_form(x, None)
    assert to_compute(fp32, torch.float32, x.numel(), None) is fp32  # nothing to convert: no copy


def test_buckets_hold_neighbouring_modules_only(tmp_path):
    """Small parameters are packed with their neighbours in model order, not with the small parameters of the
    whole model: otherwise every module would gather one bucket of biases from all layers."""
    import re
    m = _gpt2(width=128)
    with offload_for_inference(m, nvme_path=tmp_path, budget_bytes=_budget(m)) as off:
        layers = [{int(x) for pc in off.layout.bucket(g).pieces for x in re.findall(r"\.h\.(\d+)\.", pc.name)}
                  for g in range(len(off.layout.subgroups))]
        assert len(layers) > 6 and all(len(s) <= 1 for s in layers), layers
    from tierstore.zero.params.layout import Layout
    with pytest.raises(TierstoreValueError, match="frozen_groups"):
        Layout([("a", (4,), torch.float32, False), ("b", (4,), torch.float32, False)], [([], {})], 1,
               min_io_bytes=4096, bucket_bytes=8192, frozen_groups=[["a"]])


def test_one_holder_per_model_optimizer_or_offload(tmp_path):
    from tierstore.errors import MisuseError
    from tierstore.zero import OffloadConfig, Zero3Optimizer, offload_for_inference
    cfg = OffloadConfig(params="host", optimizer_states="host", gradients="host")
    owned = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = Zero3Optimizer(owned, torch.optim.AdamW, lr=1e-3, config=cfg)
    with pytest.raises(MisuseError, match="already partitioned"):
        offload_for_inference(owned, tier="host")
    opt.close()
    served = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    x = torch.randn(2, 64)
    want = served(x)
    h = offload_for_inference(served, tier="host")
    with pytest.raises(MisuseError, match="open offload for inference"):
        Zero3Optimizer(served, torch.optim.AdamW, lr=1e-3, config=cfg)
    with pytest.raises(MisuseError, match="open offload for inference"):
        offload_for_inference(served, tier="host")
    with torch.no_grad():
        assert torch.equal(served(x), want)  # the refusals touched nothing
    h.close(restore=True)
    opt2 = Zero3Optimizer(served, torch.optim.AdamW, lr=1e-3, config=cfg)  # restored: a plain model again
    opt2.close()


def test_an_offloaded_model_counts_its_parameters_true(tmp_path):
    m = _gpt2()
    want = sum(p.numel() for p in m.parameters())
    shapes = [tuple(p.shape) for p in m.parameters()]
    with offload_for_inference(m, tier="host", budget_bytes=_budget(m)):
        assert sum(p.numel() for p in m.parameters()) == want  # before the first forward
        assert [tuple(p.shape) for p in m.parameters()] == shapes
        with torch.no_grad():
            m(IDS)
        assert sum(p.numel() for p in m.parameters()) == want  # and after it
        with pytest.raises(MisuseError, match="GatheredParameters"):
            m.transformer.wte.weight.sum()


def _gpt2_under_init_peak(root: str, layers: int, width: int, budget: int, pinned: int) -> dict:
    """In a fresh process, with glibc's allocator as a program has it (no thresholds fixed): peak RSS growth of
    building a GPT-2 under zero.Init (nvme), offloading it for inference and generating from it, by phase."""
    import time

    from tierstore.bench._common import proc_status
    from tierstore.zero import OffloadConfig

    def config(n_layer):
        return transformers.GPT2Config(n_layer=n_layer, n_head=8, n_embd=width, vocab_size=256, n_positions=64,
                                       bos_token_id=None, eos_token_id=None)

    def run(n_layer, sub):
        torch.manual_seed(0)
        peaks = {}
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = proc_status("VmRSS")
        with Init(OffloadConfig(params="nvme", nvme_paths=[os.path.join(root, sub, "init")],
                                pinned_bytes=pinned)):
            model = transformers.GPT2LMHeadModel(config(n_layer)).eval()
        peaks["build"] = proc_status("VmHWM") - before
        off = offload_for_inference(model, nvme_path=os.path.join(root, sub, "w"), budget_bytes=budget)
        peaks["offload"] = proc_status("VmHWM") - before
        with torch.no_grad():
            out = model.generate(IDS[:1], max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        peaks["generate"] = proc_status("VmHWM") - before
        st = off.stats()
        off.close()
        return peaks, st, out

    run(1, "warm")  # transformers' model code imported, the engine's threads and native libraries loaded
    t0 = time.perf_counter()
    peaks, st, out = run(layers, "big")
    return {"peaks": peaks, "weights": st.weight_bytes, "resident": st.peak_resident_bytes,
            "tokens": out.shape[1] - IDS.shape[1], "seconds": time.perf_counter() - t0}


def test_gpt2_built_under_init_then_generating_holds_the_budget_not_the_model(tmp_path):
    from tierstore.zero.heap import TRIM_EVERY
    budget = 16 << 20
    pinned = max(8 << 20, budget // 4)  # the staging buffers of the offload's store; Init's store gets as much
    r = run_isolated(_gpt2_under_init_peak, str(tmp_path), 28, 512, budget, pinned, timeout=300)
    mib = 2 ** 20
    print(f"GPT-2 28 x 512 ({r['weights'] / mib:.0f} MiB of weights) built under Init, offloaded with a "
          f"{budget / mib:.0f} MiB budget, 3 tokens generated in {r['seconds']:.1f} s: peak RSS growth "
          + ", ".join(f"{k} +{v / mib:.0f} MiB" for k, v in r["peaks"].items())
          + f"; weights resident at most {r['resident'] / mib:.1f} MiB")
    assert r["tokens"] == 3 and 0 < r["resident"] <= budget
    # the weights materialised at once, the freed pages not yet given back ([Note: freed weights go back to
    # the system] in tierstore/zero/heap.py), the two stores' pinned buffers, and a fixed allowance for the
    # activations, the module being built and the allocator's slack
    bound = budget + TRIM_EVERY + 2 * pinned + (32 << 20)
    assert r["weights"] >= 2 * bound  # a model the memory would show
    assert max(r["peaks"].values()) <= bound, r["peaks"]


def test_bench_runs_disk_cases_under_one_memory_limit_or_says_why_not(tmp_path):
    """[Note: equal memory for every case] in tierstore/bench/_memlimit.py: a case's process in a cgroup is held to
    the limit, page cache included; without cgroups the reason is given (the benchmark then drops pages)."""
    import subprocess
    import sys

    from tierstore.bench._memlimit import MemoryGroup, drop_files
    from tierstore.bench.inference import limited
    assert [c for c in ("memory", "accelerate", "host-fp32", "nvme-fp32", "nvme-int8") if limited(c)] == \
        ["accelerate", "nvme-fp32", "nvme-int8"]
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(24 << 20))
    assert drop_files(str(tmp_path)) == 1
    group, why = MemoryGroup.create("test")
    if group is None:
        assert why
        pytest.skip(why)
    limit = 64 << 20
    try:
        code = f"open({str(data)!r}, 'rb').read(); import sys; sys.stdin.read()"
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); " + code],
                                stdin=subprocess.PIPE, text=True)
        try:
            group.add(proc.pid)
            assert group.limit(limit) == ""
            group.reset_peak()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            proc.stdin.close()
            assert proc.wait(60) == 0
            assert 0 < group.peak() <= limit
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        group.close()
    assert not os.path.exists(group.path)
