"""asynckv against a GPU engine: generate, stream, abort, reset the prefix cache.

    python scripts/gpu/smoke.py [--model scripts/gpu/llama8b] [--eager]

The 8B-shaped checkpoint is a config.json only: random weights (load_format
dummy), no tokenizer, token-id prompts. Prints one line per check and exits 1
on the first failure.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import AsyncEngine


async def main(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    engine = AsyncEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            load_format="dummy",
            skip_tokenizer_init=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=512,
            max_num_seqs=256,
            enforce_eager=args.eager,
            seed=0,
        )
    )
    await engine.start()
    print(f"engine started in {time.perf_counter() - t0:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=list(range(100, 164)))

    t = time.perf_counter()
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    assert final is not None and final.finished and len(final.outputs[0].token_ids) == 16
    print(f"ok generate: 16 tokens in {(time.perf_counter() - t) * 1e3:.0f} ms", flush=True)

    outs = await asyncio.gather(
        *(collect(engine, TokensPrompt(prompt_token_ids=[5 + i] * 40), params) for i in range(64))
    )
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    print("ok 64 concurrent streams", flush=True)

    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400, detokenize=False)
    stream = engine.generate(prompt, long, "to-abort")
    await stream.__anext__()
    await engine.abort("to-abort")
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.outputs[0].finish_reason == "abort", last
    print("ok abort", flush=True)

    task = asyncio.ensure_future(collect(engine, prompt, long))
    await asyncio.sleep(0.05)
    assert await engine.reset_prefix_cache(reset_running_requests=True)
    out = await task
    assert len(out.outputs[0].token_ids) == 400
    print("ok reset_prefix_cache(reset_running_requests=True) under load", flush=True)
    print("stats:", engine.stats(), flush=True)
    await engine.aclose()
    print(f"SMOKE OK in {time.perf_counter() - t0:.1f} s", flush=True)


async def collect(engine: AsyncEngine, prompt: TokensPrompt, params: SamplingParams):  # type: ignore[no-untyped-def]
    final = None
    async for out in engine.generate(prompt, params):
        final = out
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="scripts/gpu/llama8b")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--eager", action="store_true")
    asyncio.run(main(parser.parse_args()))
