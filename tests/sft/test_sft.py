"""asyncrl sft: rendering (loss on exactly the assistant tokens), data checks, training, resume."""

from __future__ import annotations

import argparse
import json
import signal

import pytest
import torch

from asyncrl.agents.base import AgentContext
from asyncrl.config import AgentConfig, load_config
from asyncrl.data.rows import DataError
from asyncrl.envs.base import resolve_env
from asyncrl.sft import trainer
from asyncrl.sft.conversations import check_row, read_rows, render_conversation
from asyncrl.sft.demos import make_demos

pytestmark = pytest.mark.timeout(180)

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}


def _conversation():
    return {"messages": [
        {"role": "user", "content": "What is 3*4+5?"},
        {"role": "assistant", "content": "Let me compute.",
         "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                          "arguments": "{\"expression\": \"3*4+5\"}"}}]},
        {"role": "tool", "name": "calculator", "content": "17"},
        {"role": "assistant", "content": "Answer: 17"},
    ], "tools": [CALC]}


def test_loss_mask_covers_exactly_the_assistant_tokens_of_a_hand_built_conversation(tokenizer):
    row = check_row(_conversation(), 0)
    traj = render_conversation(tokenizer, AgentConfig(), row)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    # by hand, in SmolLM2's ChatML: the hermes tools block in the system message (its template has no tools)
    prompt_text = tokenizer.decode(traj.prompt_ids.numpy().tolist())
    assert prompt_text.startswith("<|im_start|>system\n") and '"name": "calculator"' in prompt_text
    assert prompt_text.endswith("<|im_start|>user\nWhat is 3*4+5?<|im_end|>\n<|im_start|>assistant\n")
    turn1 = enc('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4+5"}}\n'
                "</tool_call>") + enc("<|im_end|>")
    tool = enc("\n<|im_start|>tool\n17<|im_end|>\n<|im_start|>assistant\n")
    turn2 = enc("Answer: 17") + enc("<|im_end|>")
    assert traj.response_ids.numpy().tolist() == turn1 + tool + turn2
    assert traj.loss_mask.numpy().tolist() == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)


async def test_rendering_a_demonstration_gives_the_agent_loops_own_tokens(tokenizer):
    cfg = load_config(["env=arithmetic", "env.num_train=6", "env.num_val=2"])
    env = resolve_env("arithmetic")
    report = await make_demos(AgentContext.for_config(cfg, None, tokenizer), env,
                              list(enumerate(env.build(cfg.env, "train"))))
    assert len(report.rows) == 6
    for demo in report.rows:
        played = report.trajectories[demo["data_index"]]
        rendered = render_conversation(tokenizer, cfg.agent, check_row(json.loads(json.dumps(demo)), 0))
        for name in ("prompt_ids", "response_ids", "loss_mask"):
            assert getattr(rendered, name).numpy().tolist() == getattr(played, name).numpy().tolist(), name


@pytest.mark.parametrize("row,field,match", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "{not json"}, "messages", "not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "starts with an assistant"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "not one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "text or null"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                     "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0]", "function.name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                     "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls", "only assistant"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [1]}, "tools", "OpenAI tool schemas"),
])
def test_bad_rows_are_named_by_index_and_field(row, field, match):
    with pytest.raises(DataError, match=match) as e:
        check_row(row, 7)
    assert e.value.index == 7 and e.value.field == field


def test_read_rows_names_the_file_and_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(_conversation()) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl, row 1, field 'messages': has no assistant"):
        read_rows(f)


def _args(tmp_path, data, **kw):
    ns = dict(items=[str(data), "model=custom", f"model.path={kw.pop('model')}", "agent.system_prompt=Be brief.",
                     "algorithm.micro_batch_tokens=512"],
              val=None, out=str(tmp_path / kw.pop("out", "sft")), epochs=kw.pop("epochs", 1), batch=2, lr=3e-3, seed=0,
              val_every=0, checkpoint_every=kw.pop("checkpoint_every", 0))
    return argparse.Namespace(**ns)


def _tiny_data(tmp_path, n=4):
    f = tmp_path / "tiny.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"Answer: {2 * i}"}]} for i in range(n)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _run(a) -> int:
    return trainer.main(argparse.Namespace(argv=[*a.items, "--out", a.out, "--epochs", str(a.epochs), "--batch",
                                                 str(a.batch), "--lr", str(a.lr), "--checkpoint-every",
                                                 str(a.checkpoint_every)]))


def test_sft_lowers_the_loss_and_the_model_says_its_demonstration_greedily(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    data = _tiny_data(tmp_path, n=2)
    assert _run(_args(tmp_path, data, model=tiny_model_dir, epochs=40)) == 0
    recs = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/train_loss"] for r in recs]
    assert len(losses) == 40 and losses[-1] < 0.2 * losses[0]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "final").eval()
    from asyncrl.config import ModelConfig
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    cfg = AgentConfig(system_prompt="Be brief.")
    for row in read_rows(data):
        t = render_conversation(tok, cfg, row)
        prompt = torch.tensor([t.prompt_ids.numpy().tolist()])
        want = t.response_ids.numpy().tolist()
        got = model.generate(prompt, max_new_tokens=len(want), do_sample=False)[0, prompt.shape[1]:].tolist()
        assert got == want, (tok.decode(got), tok.decode(want))


def test_an_interrupted_sft_run_resumes_to_the_same_weights(tmp_path, tiny_model_dir, monkeypatch, capsys):
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    from safetensors.torch import load_file

    data = _tiny_data(tmp_path, n=4)
    assert _run(_args(tmp_path, data, model=tiny_model_dir, epochs=2, out="straight", checkpoint_every=2)) == 0

    from asyncrl.learner.worker import LearnerWorker

    calls = {"n": 0}
    original = LearnerWorker.train_step

    def dies_at_step_3(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as a Ctrl-C between checkpoints: step 2's checkpoint is the newest
        return original(self, batch)

    monkeypatch.setattr(LearnerWorker, "train_step", dies_at_step_3)
    # the interrupt is reported, not raised: exit status 128 + SIGINT and the resume hint on stderr
    assert _run(_args(tmp_path, data, model=tiny_model_dir, epochs=2, out="resumed", checkpoint_every=2)) == 130
    assert "asyncrl sft: interrupted (SIGINT): the same command resumes" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is previous_sigterm  # the command's handlers were put back
    monkeypatch.setattr(LearnerWorker, "train_step", original)
    assert _run(_args(tmp_path, data, model=tiny_model_dir, epochs=2, out="resumed", checkpoint_every=2)) == 0
    steps = [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # steps 1-2, then the resumed 3-4: none repeated
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_refuses_bad_arguments_before_loading_anything(tmp_path, capsys):
    data = _tiny_data(tmp_path)
    assert trainer.main(argparse.Namespace(argv=[str(data), "--epochs", "0"])) == 2
    assert "--epochs must be >= 1" in capsys.readouterr().err
    assert trainer.main(argparse.Namespace(argv=[str(tmp_path / "missing.jsonl")])) == 2
    assert "no such file" in capsys.readouterr().err
    assert trainer.main(argparse.Namespace(argv=[])) == 2
    assert "exactly one training file" in capsys.readouterr().err


def test_sft_refuses_a_tool_parser_that_cannot_render_naming_it_before_training(tmp_path, tiny_model_dir, capsys,
                                                                               plugin_registry):
    plugin = tmp_path / "parse_only.py"
    plugin.write_text("from asyncrl.agents.parsers import HermesParser\nfrom asyncrl.registry import register\n\n\n"
                      "@register('tool_parser', 'sft_parse_only')\nclass ParseOnly:\n    def parse(self, text):\n"
                      "        return HermesParser().parse(text)\n")
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps(_conversation()) + "\n")
    a = _args(tmp_path, data, model=tiny_model_dir)
    a.items += [f"plugins=[{plugin}]", "agent.tool_parser=sft_parse_only"]
    assert _run(a) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncrl sft: agent.tool_parser=sft_parse_only is the tool_parser plugin ParseOnly (config "
                          f"{plugin}), which has no render(content, calls)"), err
    assert not (tmp_path / "sft" / "metrics.jsonl").exists()  # refused before the learner started
