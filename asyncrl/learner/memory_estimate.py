"""An estimate of one learner rank's peak resident memory in a step, for the preflight to refuse a
configuration that cannot fit the machine before anything starts (asyncrl/run/preflight.py).

    state        = P x (4 master weights + 4 gradients + 8 AdamW moments)   (LoRA: P x 4 + P_lora x 16)
                   / ranks (FSDP2 shards it), + P x 4 for a reference model (kl_coef > 0)
    activations  = T x layers x a,     a = bytes x (20 x hidden + 6 x intermediate)
                   with gradient checkpointing: T x (layers x hidden x 8 + a)   (each layer's input kept, one
                   layer's activations recomputed at a time)
    logits       = min(C, T) x V x 20  (bf16 and float32 copies, log-softmax, softmax, gradients)

with P parameters, T = algorithm.micro_batch_tokens, C = algorithm.logits_chunk_tokens (0: T), V the
vocabulary, bytes = 2 under bf16 autocast, else 4. The constants were fitted to SmolLM2-135M (hidden 576,
intermediate 1536, 30 layers) on this project's CPU: 39 KB a token and layer in bf16 autocast without
checkpointing, measured as the step's peak growth (docs/benchmarks.md "Memory"). An estimate, not a bound:
the allocator's fragmentation comes on top (up to a third more, measured).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int

    @staticmethod
    def from_config(c: dict) -> ModelShape:
        """From a Hugging Face config.json's fields (a decoder-only LM); the parameter count as a Llama's."""
        hidden, inter = int(c["hidden_size"]), int(c.get("intermediate_size") or 4 * int(c["hidden_size"]))
        layers, vocab = int(c["num_hidden_layers"]), int(c["vocab_size"])
        heads = int(c.get("num_attention_heads") or 1)
        kv = int(c.get("num_key_value_heads") or heads)
        attn = hidden * hidden * 2 + 2 * hidden * (hidden // heads) * kv
        per_layer = attn + 3 * hidden * inter + 2 * hidden
        tied = c.get("tie_word_embeddings", True)
        return ModelShape(params=layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden,
                          hidden=hidden, intermediate=inter, layers=layers, vocab=vocab)


# the default model, SmolLM2-135M-Instruct (its GGUF file carries no config.json)
SMOLLM2_135M = ModelShape(params=134_515_008, hidden=576, intermediate=1536, layers=30, vocab=49152)


@dataclass(frozen=True)
class StepEstimate:
    state_gb: float
    activations_gb: float
    logits_gb: float

    @property
    def total_gb(self) -> float:
        return self.state_gb + self.activations_gb + self.logits_gb

    def describe(self) -> str:
        return (f"{self.total_gb:.1f} GiB ({self.state_gb:.1f} weights, gradients and optimizer state, "
                f"{self.activations_gb:.1f} activations, {self.logits_gb:.1f} logits)")


def learner_step(shape: ModelShape, micro_batch_tokens: int, logits_chunk_tokens: int, checkpointing: bool,
                 bf16: bool, ranks: int = 1, lora_params: int = 0, reference: bool = False) -> StepEstimate:
    """One learner rank's peak in a step (module docstring)."""
    p = shape.params
    state = (p * 4 + lora_params * 16) if lora_params else p * 16
    state = state / max(ranks, 1) + (p * 4 if reference else 0)
    per = (2 if bf16 else 4) * (20 * shape.hidden + 6 * shape.intermediate)
    t = micro_batch_tokens
    acts = t * (shape.layers * shape.hidden * 8 + per) if checkpointing else t * shape.layers * per
    chunk = min(logits_chunk_tokens or t, t)
    return StepEstimate(state / GIB, acts / GIB, chunk * shape.vocab * 20 / GIB)


def lower_learner_memory(micro_batch_tokens: int, checkpointing: bool) -> str:
    """The settings that lower a learner rank's step, as one clause: every message about the learner's memory
    (the preflight's refusal, the learner's and the driver's memory stops) ends with it."""
    ways = [f"lower algorithm.micro_batch_tokens (now {micro_batch_tokens})"]
    if not checkpointing:
        ways.append("set model.gradient_checkpointing=true")
    return ", ".join(ways) + ", or set trainer.learner_memory_gb to have the micro-batch chosen"
