"""The reference decoder-only LM (Llama / Qwen2 / Qwen3 / MoE families) with HF-compatible module names.

Module names mirror ``transformers`` (``embed_tokens``, ``layers.N.self_attn.q_proj``, ``mlp.gate_proj``,
``norm``, ``lm_head``) so HF conversion is a near-identity rename. The model is parallel-aware only through
data it exposes (the model protocol of ``models/protocol.py``: ``tp_plan``, ``pipeline_units``, ...) and through
what ``on_tensor_parallel`` records (``tp_mesh``, ``vocab_start``) for the vocab-parallel loss.

Pipeline stages are built by deep-copying the model and setting ``embed_tokens`` / ``norm`` / ``lm_head`` to
``None`` and deleting entries of ``layers``; ``forward`` runs whatever parts are present.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_flagscale.config import TransformerConfig
from lightning_flagscale.models.attention import build_attention
from lightning_flagscale.models.decoder_plan import check_decoder_tp, decoder_tp_plan
from lightning_flagscale.models.init import canonical_fqn, copy_global_into, seed_for
from lightning_flagscale.models.layers import MLP, RMSNorm, RotaryEmbedding
from lightning_flagscale.moe import build_moe
from lightning_flagscale.parallel.tensor_parallel.apply import vocab_parallel_cross_entropy

__all__ = ["CausalLM", "DecoderBlock", "MTPLayer", "MultiTokenPrediction", "mtp_labels", "token_mean"]


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: TransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = build_attention(config)  # GQA, or MLA when config.is_mla
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_moe:
            self.mlp = build_moe(config, layer_idx)
        else:
            self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor | None = None) -> Tensor:
        # Positional arguments on purpose: TP's PrepareModuleInput matches inputs by position.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(DecoderBlock):
    """One DeepSeek-V3 multi-token-prediction module (the k-th of ``num_nextn_predict_layers``).

    ``eh_proj([enorm(emb(t_{i+k})), hnorm(h_i)])`` (2h -> h), then one transformer block; ``norm`` is the module's own
    final RMSNorm (HF ``shared_head.norm``) before the LM head shared with the main model. Block names are HF's
    (``self_attn.*``, ``mlp.*``), so the checkpoint layer ``model.layers.{num_hidden_layers + k - 1}`` maps 1:1.
    """

    def __init__(self, config: TransformerConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def forward(  # type: ignore[override]
        self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, segment_ids: Tensor | None = None
    ) -> Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return super().forward(x, cos, sin, segment_ids)


class MultiTokenPrediction(nn.Module):
    """The MTP modules (``layers``) and the embedding they share with the main model (``embed_tokens``: the very
    Parameter of the main embedding; a copy kept in sync on a last pipeline stage, like a tied LM head)."""

    def __init__(self, config: TransformerConfig, padded_vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(padded_vocab_size, config.hidden_size)
        n = config.num_layers
        self.layers = nn.ModuleDict({str(k): MTPLayer(config, n + k) for k in range(config.num_nextn_predict_layers)})


def mtp_labels(labels: Tensor, k: int, segment_ids: Tensor | None = None) -> Tensor:
    """Targets of the k-th MTP module from next-token ``labels`` [B, S]: ``labels`` shifted left by ``k`` (the
    token k + 1 positions ahead), ``-100`` in the last ``k`` positions and where the target lies in another packed
    document (``segment_ids`` differ)."""
    out = torch.full_like(labels, -100)
    if k < labels.shape[-1]:
        shifted = labels[..., k:]
        if segment_ids is not None:
            same = segment_ids[..., k:] == segment_ids[..., :-k]
            shifted = torch.where(same, shifted, torch.full_like(shifted, -100))
        out[..., :-k] = shifted
    return out


def _shift_tokens(tokens: Tensor, k: int) -> Tensor:
    """Token ids shifted left by ``k`` (zeros at the end: they only reach positions whose targets are -100).

    ``tokens`` [B, S, D] are already shifted on the whole sequence (:meth:`CausalLM.prepare_batch`): column
    ``k - 1`` holds the ids ``k`` positions ahead."""
    if tokens.dim() == 3:
        return tokens[..., k - 1]
    return torch.cat([tokens[..., k:], tokens.new_zeros(*tokens.shape[:-1], min(k, tokens.shape[-1]))], dim=-1)


class _AddGradOnly(torch.autograd.Function):
    """Returns ``main`` unchanged; in backward ``extra`` gets the same gradient as ``main``, so ``extra`` trains
    with the main loss's scale (token factor, accumulation, pipeline scale) while the reported loss stays the main
    one (Megatron's ``MTPLossAutoScaler`` idea)."""

    @staticmethod
    def forward(ctx, main: Tensor, extra: Tensor) -> Tensor:  # type: ignore[override]
        return main.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return grad, grad


class CausalLM(nn.Module):
    """Decoder-only causal LM; see the module docstring and the shared model contract.

    ``vocab_multiple`` pads the embedding / LM head rows to a multiple (the TP size) so the vocab splits evenly;
    padded rows are zero-initialised, masked out of the loss and dropped by ``logits()``, so padding never changes
    results.
    """

    def __init__(self, config: TransformerConfig, vocab_multiple: int = 1) -> None:
        super().__init__()
        if vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {vocab_multiple}.")
        self.config = config
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = config.padded_vocab_size(vocab_multiple)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(self.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderBlock(config, i) for i in range(config.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, self.padded_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.rope_dim, config.rope_theta, config.rope_scaling)
        # DeepSeek-V3 multi-token prediction (None without): runs after the main blocks, on the last pipeline stage.
        self.mtp: MultiTokenPrediction | None = None
        if config.num_nextn_predict_layers:
            self.mtp = MultiTokenPrediction(config, self.padded_vocab_size)
        # Head outputs of the MTP modules from the last forward, with their segment ids and pre-shifted targets.
        self._mtp_pending: tuple[list[Tensor], Tensor | None, Tensor | None] | None = None
        self._mtp_log: list[Tensor] | None = None  # per depth: [token-loss sum, label count] of this rank
        # lambda of the loss; the LightningModule sets it each step under config.mtp_loss_weight_schedule
        self.mtp_loss_weight = config.mtp_loss_weight
        # Set by on_tensor_parallel (called by parallel.tensor.apply_tp): the TP mesh, whether activations between blocks are sequence-sharded,
        # and the first vocab row this rank's LM-head shard holds.
        self.tp_mesh = None
        self.sequence_parallel = False
        self.vocab_start = 0
        self.tie_weights()

    # ---- structure ---------------------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very Parameter of ``embed_tokens`` (when tied and both parts are present)."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
        if getattr(self, "mtp", None) is not None and self.embed_tokens is not None:
            self.mtp.embed_tokens.weight = self.embed_tokens.weight  # MTP shares the main embedding

    def _apply(self, fn: Callable, recurse: bool = True):
        # ``to_empty``/``to`` may replace each module's Parameter objects independently, which would silently untie
        # the shared embedding; re-tie after every such conversion.
        result = super()._apply(fn, recurse)
        self.tie_weights()
        return result

    def pipeline_units(self) -> list[str]:
        """Module names in execution order, the granularity at which pipeline parallelism cuts stages."""
        units = ["embed_tokens", *(f"layers.{i}" for i in self.layers), "norm", "lm_head"]
        return [*units, "mtp"] if self.mtp is not None else units

    def pipeline_inputs(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        mtp_input_ids: Tensor | None = None,
        mtp_labels: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor | None]]:
        """Stage inputs under pipeline parallelism: ``x`` feeds the first stage, the rest reaches every stage.

        Positions are always explicit: a later stage under sequence parallelism receives a sequence shard and could
        not derive the global positions from its input's length. With MTP the token ids also reach every stage
        (``mtp_input_ids``): the last stage embeds them shifted.
        """
        if position_ids is None:
            batch, seq = x.shape[:2]
            position_ids = torch.arange(seq, device=x.device).expand(batch, seq).contiguous()
        inputs = {"position_ids": position_ids, "segment_ids": segment_ids}
        if self.mtp is not None:
            inputs["mtp_input_ids"] = x if mtp_input_ids is None else mtp_input_ids
            inputs["mtp_labels"] = mtp_labels
        return x, inputs

    @property
    def cp_sequence_keys(self) -> tuple[str, ...]:
        """Per-token keys :meth:`prepare_batch` adds, which context parallelism shards with the token ids."""
        return ("mtp_input_ids", "mtp_labels") if getattr(self, "mtp", None) is not None else ()

    def prepare_batch(self, batch: dict) -> dict:
        """The full batch, before context parallelism shards the sequence, with what the MTP modules need from the
        whole sequence (model protocol ``ContextParallelBatch``): ``mtp_input_ids`` [B, S, D], column ``k - 1`` the
        token ids ``k`` positions ahead, and ``mtp_labels`` [B, S, D], module k's targets (:func:`mtp_labels`). The
        last positions of a load-balanced CP chunk look ahead into another rank's chunk; shifting first, as the
        next-token labels are, gives every rank its tokens without an exchange. Without MTP the batch is unchanged."""
        if self.mtp is None or "mtp_input_ids" in batch:
            return batch
        segment_ids = batch.get("segment_ids")
        mask = batch.get("attention_mask")
        if segment_ids is None and mask is not None and not bool(mask.all()):
            segment_ids = mask.long()  # padding as a segment of its own, as CausalLMModule's loss does
        depth = range(1, len(self.mtp.layers) + 1)
        tokens, labels = batch["input_ids"], batch["labels"]
        return {
            **batch,
            "mtp_input_ids": torch.stack([_shift_tokens(tokens, k) for k in depth], dim=-1),
            "mtp_labels": torch.stack([mtp_labels(labels, k, segment_ids) for k in depth], dim=-1),
        }

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """Module name -> DTensor ``ParallelStyle`` for the parts present (see ``models/decoder_plan.py``)."""
        return decoder_tp_plan(self, sequence_parallel)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise naming the size that ``tp`` does not divide (heads, widths, padded vocab)."""
        check_decoder_tp(self, tp)

    def on_tensor_parallel(self, tp_mesh, sequence_parallel: bool) -> None:
        """Record what the vocab-parallel loss and ``logits`` need; keep a tied embedding one Parameter."""
        self.tie_weights()  # parallelize_module distributed embed_tokens and lm_head into two separate Parameters
        self.tp_mesh = tp_mesh
        self.sequence_parallel = sequence_parallel
        self.vocab_start = tp_mesh.get_local_rank() * (self.padded_vocab_size // tp_mesh.size())

    # ---- compute ------------------------------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
        mtp_input_ids: Tensor | None = None,
        mtp_labels: Tensor | None = None,
    ) -> Tensor:
        """Token ids [B, S] (or hidden states [B, S, H] without ``embed_tokens``) -> hidden states or head output.

        ``position_ids`` are global positions for RoPE (default ``arange(S)``); ``segment_ids`` restrict attention
        to tokens of the same packed document. ``mtp_input_ids``: the token ids for the MTP modules on a stage that
        has no embedding (default: ``x`` when it is token ids), or the ids already shifted with their targets
        ``mtp_labels`` [B, S, D] (:meth:`prepare_batch`; what a context-parallel shard needs).
        """
        batch, seq = x.shape[:2]
        if self.embed_tokens is not None:
            h = self.embed_tokens(x)
        else:
            h = x
            if self.sequence_parallel:  # a later pipeline stage receives this rank's sequence shard
                seq *= self.tp_mesh.size()
        if position_ids is None:
            position_ids = torch.arange(seq, device=x.device).unsqueeze(0).expand(batch, seq)
        tokens = mtp_input_ids if mtp_input_ids is not None else (x if self.embed_tokens is not None else None)
        return self.run_layers(h, position_ids, segment_ids, mtp_input_ids=tokens, mtp_labels=mtp_labels)

    def run_layers(
        self,
        h: Tensor,
        position_ids: Tensor,
        segment_ids: Tensor | None = None,
        mtp_input_ids: Tensor | None = None,
        mtp_labels: Tensor | None = None,
    ) -> Tensor:
        """Hidden states [B, S, H] after the embedding -> the blocks present, then the norm and head if present.

        The one decoder layer loop: every model built on ``CausalLM`` (the VLM included) embeds its inputs its own
        way and continues here. ``position_ids`` are [B, S] (or [3, B, S] for M-RoPE) global positions.
        """
        if len(self.layers) or self.mtp is not None:
            # Under sequence parallelism the embedding output is the local sequence shard; the rotary tables cover
            # the full sequence because attention sees the all-gathered sequence.
            cos, sin = self.rotary_emb(position_ids, self._compute_dtype(h))
            for layer in self.layers.values():
                h = layer(h, cos, sin, segment_ids)
        if self.mtp is not None:
            self._mtp_pending = (self._run_mtp(h, mtp_input_ids, cos, sin, segment_ids), segment_ids, mtp_labels)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    def _run_mtp(
        self, h: Tensor, tokens: Tensor | None, cos: Tensor, sin: Tensor, segment_ids: Tensor | None
    ) -> list[Tensor]:
        """Head outputs of the MTP modules: module k takes the previous hidden states (the main model's before its
        final norm, then module k-1's) and the embedding of the tokens shifted by k (DeepSeek-V3, section 2.2)."""
        if self.lm_head is None or tokens is None:
            raise RuntimeError(
                "The MTP modules need the LM head and the token ids on their stage (mtp_input_ids); a stage split that"
                " separates 'mtp' from 'lm_head' or a caller without token ids cannot run them."
            )
        outputs = []
        for k, layer in enumerate(self.mtp.layers.values(), start=1):
            h = layer(h, self.mtp.embed_tokens(_shift_tokens(tokens, k)), cos, sin, segment_ids)
            outputs.append(self.lm_head(layer.norm(h)))
        return outputs

    def mtp_logits(self) -> list[Tensor]:
        """Full logits [B, S, vocab_size] of each MTP module from the last forward (position i of module k predicts
        the token at i + k + 1)."""
        if self._mtp_pending is None:
            raise RuntimeError("No MTP output: the model has no MTP modules or ran no forward since the last loss.")
        return [self.logits(out) for out in self._mtp_pending[0]]

    def pop_mtp_loss(self, group: dist.ProcessGroup | None = None) -> Tensor | None:
        """The MTP cross-entropy since the last call, for logging (token mean per module, averaged over the modules,
        without the weight), or None when no MTP loss was computed (then no collective runs).

        Without ``group``, this rank's token mean. With ``group``, the ranks that hold disjoint tokens of this stage
        (data x context parallel), each module's loss sum and label count are all-reduced first: the global token
        mean one process would log. Only ranks that ran the MTP modules may pass it (all of the group's do)."""
        log, self._mtp_log = self._mtp_log, None
        if log is None:
            return None
        parts = torch.stack(log).double()  # [D, 2]: per module, loss sum and label count
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(parts, group=group)
        return (parts[:, 0] / parts[:, 1].clamp(min=1)).mean().float()

    @staticmethod
    def _compute_dtype(h: Tensor) -> torch.dtype:
        return torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype

    def loss_fn(self, head_output: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
        """Cross-entropy summed over tokens with ``labels != -100``, divided by ``num_items_in_batch``.

        ``num_items_in_batch`` is the normaliser of the whole optimizer step (the global count of label tokens over
        all micro-batches, accumulation steps and data x context ranks, as in Hugging Face's ``num_items_in_batch``),
        so that the contributions of every micro-batch add up to one token mean. Without it the loss is the local
        token mean. Padded vocab columns never count. Under TP ``head_output`` is this rank's vocab shard and the
        reduction is vocab-parallel (Megatron-style).
        """
        main = token_mean(self._token_losses(head_output, labels), labels, num_items_in_batch)
        pending, self._mtp_pending = self._mtp_pending, None
        if pending is None:
            return main
        # MTP (DeepSeek-V3): lambda / D * sum_k L_k, each L_k over the main loss's normaliser; it trains with the
        # main loss's gradient scale but is not part of the returned (reported) loss: see pop_mtp_loss.
        outputs, segment_ids, shifted = pending
        count = (labels != -100).sum() if num_items_in_batch is None else num_items_in_batch
        total, log = None, self._mtp_log or [torch.zeros(2, device=main.device) for _ in outputs]
        for k, (out, entry) in enumerate(zip(outputs, log), start=1):
            targets = mtp_labels(labels, k, segment_ids) if shifted is None else shifted[..., k - 1]
            losses = self._token_losses(out, targets)
            term = token_mean(losses, targets, count)
            total = term if total is None else total + term
            entry += torch.stack([losses.detach().float().sum(), (targets != -100).sum().float()]).to(entry.device)
        self._mtp_log = log
        return _AddGradOnly.apply(main, total * (self.mtp_loss_weight / len(outputs)))

    def _token_losses(self, head_output: Tensor, labels: Tensor) -> Tensor:
        """Per-token cross-entropy (0 where ``labels == -100``), vocab-parallel under TP."""
        if self.tp_mesh is not None:
            return vocab_parallel_cross_entropy(
                head_output, labels, self.tp_mesh.get_group(), self.vocab_start, self.vocab_size
            )
        logits = head_output[..., : self.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="none")

    def logits(self, head_output: Tensor) -> Tensor:
        """Full logits over the real vocabulary [B, S, vocab_size] (gathered over TP)."""
        if self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            head_output = DTensor.from_local(head_output, self.tp_mesh, [Shard(head_output.dim() - 1)]).full_tensor()
        return head_output[..., : self.vocab_size]

    def moe_aux_losses(self) -> dict[str, Tensor]:
        """Detached auxiliary losses (coefficients applied) of the last forward, summed over MoE blocks, by name.

        For logging only: the MoE blocks already attach these losses to the backward pass themselves
        (``moe.router.AttachAuxLoss``), so adding them to the training loss would count them twice.
        """
        totals: dict[str, Tensor] = {}
        mtp_layers = list(self.mtp.layers.values()) if self.mtp is not None else []
        for layer in [*self.layers.values(), *mtp_layers]:
            for name, value in getattr(layer.mlp, "last_aux_losses", {}).items():
                totals[name] = totals[name] + value if name in totals else value
        return totals

    # ---- initialisation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init that does not depend on the parallel layout, the vocab padding or the device.

        Each parameter draws from its own generator seeded by ``seed`` and its FQN; the full (unsharded, unpadded)
        tensor is generated and this rank's DTensor shard copied out of it. Norm weights are ones, biases zeros,
        other weights ``N(0, initializer_range)``; padded vocab rows zero. Buffers are zeroed, then submodules with
        a ``reset_buffers()`` method (e.g. MoE router state) re-initialise theirs.
        """
        std = self.config.initializer_range
        tied = self.config.tie_word_embeddings
        owners = {id(p): m for m in self.modules() for p in m.parameters(recurse=False)}
        # Every value is drawn on the CPU, named explicitly, and copied to wherever the parameter lives: Lightning
        # runs the init under a default-device context (cuda under accelerator="gpu"), in which a bare
        # ``torch.randn(generator=<cpu generator>)`` fails (issue 37). The CPU draw also keeps values device-free.
        cpu = torch.device("cpu")
        for fqn, param in self.named_parameters():
            name = canonical_fqn(fqn)
            full_shape = tuple(param.shape)  # global shape for DTensors
            if isinstance(owners[id(param)], RMSNorm):
                full = torch.ones(full_shape, device=cpu)
            elif name.endswith("bias"):
                full = torch.zeros(full_shape, device=cpu)
            else:
                # A tied head alone on the last pipeline stage must start equal to the first stage's embedding.
                seed_name = "embed_tokens.weight" if tied and name == "lm_head.weight" else name
                if name == "mtp.embed_tokens.weight":  # the main embedding's copy on a last pipeline stage
                    seed_name = "embed_tokens.weight"
                gen = torch.Generator(device=cpu).manual_seed(seed_for(seed, seed_name))
                real_shape = (min(full_shape[0], self.vocab_size), *full_shape[1:]) if _is_vocab(name) else full_shape
                full = torch.zeros(full_shape, device=cpu)
                full[: real_shape[0]] = torch.randn(real_shape, generator=gen, device=cpu) * std
            copy_global_into(param, full)
        for module in self.modules():
            for buf in module.buffers(recurse=False):
                buf.zero_()
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()


def token_mean(losses: Tensor, labels: Tensor, num_items_in_batch: Tensor | int | None = None) -> Tensor:
    """Sum of per-token ``losses`` divided by ``num_items_in_batch`` (default: the local count of labels != -100)."""
    if num_items_in_batch is None:
        num_items_in_batch = (labels != -100).sum()
    if isinstance(num_items_in_batch, Tensor):
        return losses.sum() / num_items_in_batch.to(losses.device).clamp(min=1)
    return losses.sum() / max(int(num_items_in_batch), 1)


def _is_vocab(name: str) -> bool:
    return name.startswith(("embed_tokens.", "lm_head.", "mtp.embed_tokens."))
