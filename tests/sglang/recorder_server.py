"""One SGLang app (recorder backend, weight_recorder.py) as a process of its own, for tests with several
engines: SGLang's app and its state are module globals, one per process. Prints its URL, serves until
its stdin closes.

    python -m tests.sglang.recorder_server [--die-after N]

--die-after N: its model runner exits once it has received N tensors of a broadcast (killed
mid-broadcast), and the server with it, as SGLang's launcher takes the whole server down when a
scheduler process dies. The model runner joins update groups with SGLang's own timeout (none: torch's
30 minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--die-after", type=int, default=None)
    args = ap.parse_args()
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    from tests.sglang.conftest import SGLangApp
    from tests.sglang.weight_recorder import ModelRunner, WeightRecorder

    d = tempfile.mkdtemp(prefix="sglang_cfg_")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(d)
    server_args = ServerArgs(model_path=d, weight_version="0", skip_tokenizer_init=True, device="cpu", dtype="float32")
    runtime_context.publish(server_args, role=next(iter(runtime_context.ROLE_NAMESPACE_SETS)))
    runner = ModelRunner(group_timeout=None)
    if args.die_after is not None:
        runner.call("die_after", args.die_after)
    tm = WeightRecorder(server_args, runner, exit_with_runner=True)
    with SGLangApp(tm) as app:
        print(app.url, flush=True)
        sys.stdin.read()
    runner.close()
    os._exit(0)


if __name__ == "__main__":
    main()
