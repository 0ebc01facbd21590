"""The worker process of one case of `bench inference` (inference.py): `python -m tierstore.bench._infer_case
SPEC_JSON`. It loads the saved model its case's way, measures the perplexity on held-out text, takes a warm-up
generation, then answers the parent's 'step' with one timed greedy generation (seconds, tokens, the kernel's
bytes read) and 'done' with its peak RSS ([Note: one worker process per case] in _harness.py).

Cases: memory (from_pretrained, in RAM: the reference), accelerate (accelerate's disk_offload onto the numpy
memmaps the parent wrote, on a model built on the meta device: loaded module by module), and tierstore's tiers:
host / nvme with the weights stored in fp32, bf16 or int8 (offload_for_inference from the safetensors file onto
meta parameters; fp32 compute). The baseline RSS it reports is taken once every case's libraries are imported.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# case -> (tier, weights_dtype name) for tierstore's cases
TIERSTORE_CASES = {"host-fp32": ("host", None), "host-bf16": ("host", "bfloat16"), "nvme-fp32": ("nvme", None),
                   "nvme-bf16": ("nvme", "bfloat16"), "nvme-int8": ("nvme", "int8")}
CASES = ("memory", "accelerate", *TIERSTORE_CASES)


def _load(case: str, spec: dict):
    """(model, the offload handle or None)."""
    import torch
    import transformers

    path = spec["model_dir"]
    if case == "memory":
        return transformers.GPT2LMHeadModel.from_pretrained(path).eval(), None
    from accelerate import init_empty_weights
    config = transformers.GPT2Config.from_pretrained(path)
    with init_empty_weights():
        m = transformers.GPT2LMHeadModel(config).eval()
    m.tie_weights()
    if case == "accelerate":  # onto the memmaps the parent wrote: nothing is loaded into memory here
        from accelerate import disk_offload
        disk_offload(m, offload_dir=spec["acc_dir"], execution_device=torch.device("cpu"))
        return m, None

    from ..zero import offload_for_inference
    tier, wd = TIERSTORE_CASES[case]
    off = offload_for_inference(m, tier=tier, nvme_path=os.path.join(spec["dir"], case),
                                budget_bytes=spec["budget"], checkpoint=path,
                                weights_dtype=None if wd is None else (wd if wd == "int8" else getattr(torch, wd)))
    return m, off


def perplexity(model, text: bytes, windows: int, context: int) -> float:
    """exp(mean next-byte cross-entropy) over `windows` consecutive windows of `context` bytes of `text`."""
    import torch
    ids = torch.tensor(list(text[:windows * context]), dtype=torch.long).view(windows, context)
    losses = []
    with torch.no_grad():
        for i in range(windows):
            losses.append(float(model(ids[i:i + 1], labels=ids[i:i + 1]).loss))
    return math.exp(sum(losses) / len(losses))


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    from . import _harness
    _harness.setup(spec["threads"])
    import torch
    # Softmax leaves denormal probabilities that this CPU multiplies many times slower than normal numbers: in
    # a 300M GPT-2 that cost more than reading its weights. Every case flushes them, so I/O is what differs.
    torch.set_flush_denormal(True)
    import transformers
    transformers.logging.set_verbosity_error()
    from ..gpt import stdlib_text

    case = spec["case"]
    import accelerate  # noqa: F401  (every case imports the same libraries before its baseline RSS)

    from .. import zero  # noqa: F401
    rss_base = _harness.proc_status("VmRSS")
    t0 = time.perf_counter()
    model, off = _load(case, spec)
    load_s = time.perf_counter() - t0
    rss_loaded = _harness.proc_status("VmRSS")
    text = stdlib_text(spec["text_bytes"])[0]
    held_out = text[len(text) // 2:]  # the model was trained on the first half
    ppl = perplexity(model, held_out, spec["ppl_windows"], spec["context"])
    prompt = torch.tensor([list(held_out[-spec["prompt"]:])], dtype=torch.long)
    n = spec["tokens"]

    def generate(tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                  pad_token_id=0)

    with open("/proc/self/clear_refs", "w") as f:  # peak RSS from here on: generation, not loading
        f.write("5")
    first = generate(2)  # warm-up: the trace recorded, threads started
    outputs: list[list[int]] = []

    def one_step() -> dict:
        r0 = _harness.proc_io()["nvme_read"]
        t = time.perf_counter()
        out = generate(n)
        dt = time.perf_counter() - t
        outputs.append(out[0, prompt.shape[1]:].tolist())
        return {"s": dt, "tokens": n, "read": _harness.proc_io()["nvme_read"] - r0}

    def final() -> dict:
        st = off.stats() if off is not None else None
        return {"stored_bytes": st.stored_bytes if st else None, "peak_weights": st.peak_resident_bytes if st else None,
                "convert_s": st.convert_s if st else None, "forwards": st.forwards if st else None,
                "tokens_out": outputs[-1] if outputs else first[0].tolist()}

    return _harness.serve(one_step, 0, final, {"load_s": load_s, "rss_loaded": rss_loaded, "ppl": ppl,
                                               "rss_base": rss_base})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
