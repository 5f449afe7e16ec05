"""What runs, said once: the start-up summary (one INFO block after the models are ready) and the same facts as
JSON on ``/health``. Torch-free: the engine reports its own facts (``runtime_info``)."""

from __future__ import annotations

from typing import Any

from app.server.state import ServerState


def server_facts(state: ServerState, engine: dict[str, Any]) -> dict[str, Any]:
    """The served models with their kinds and names, and the chat engine's facts (weights, threads, KV pool,
    limits, batch invariance)."""
    models: list[dict[str, Any]] = [
        {"names": list(entry.names), "kind": entry.kind, "max_model_len": entry.max_model_len}
        for entry in state.registry.entries
    ]
    for model, pooled in zip(models, state.pool.entries, strict=False):  # the chat models come first
        model.update(status=pooled.status, max_model_len=pooled.max_model_len)
    if state.embeddings is not None:
        encoder = state.embeddings.encoder
        spec = getattr(encoder, "spec", None)
        models[-1].update(dimensions=encoder.dimensions, pooling=list(spec.pooling) if spec else None,
                          normalize=spec.normalize if spec else None, dtype="float32")  # fmt: skip
    models[0].update({key: engine[key] for key in ("weights",) if key in engine})
    return {"models": models, "engine": engine, "speculative": engine.get("speculative", "none")}


def startup_summary(state: ServerState, engine: dict[str, Any], address: str) -> str:
    facts = server_facts(state, engine)
    lines = [f"smolserve ready on {address}"]
    for model in facts["models"]:
        if model["kind"] == "embed":
            pooling = "+".join(model["pooling"]) + " pooling, " if model.get("pooling") else ""
            detail = f"{model['dtype']}, {pooling}{model['dimensions']} dimensions"
        else:
            detail = model.get("weights", "weights not reported by the engine")
        if model.get("status") == "unloaded":
            detail = "loaded when first asked for"
        room = f"up to {model['max_model_len']} tokens" if model["max_model_len"] else "context read when loaded"
        lines.append(f"  {model['kind']} model {', '.join(model['names'])}: {detail}; {room}")
    if "threads" in engine:
        lines.append(f"  threads: {engine['threads']} of at most {engine['max_threads']} ({engine['threads_reason']})")
    kv = engine.get("kv_cache")
    if kv:
        lines.append(f"  KV cache: {kv['blocks']} blocks of {kv['block_size']} = {kv['tokens']} tokens, "
                     f"{kv['bytes'] / 2**30:.2f} GiB, {kv['dtype']}; prefix caching "
                     f"{'on' if engine['prefix_caching'] else 'off'}")  # fmt: skip
        if state := engine.get("recurrent_state"):
            kept = (
                (
                    f"; kept at up to {state['kept_at_block_ends']} cached blocks' ends for the prefix cache, "
                    f"{state['kept_bytes'] / 2**20:.1f} MiB at most"
                )
                if state["kept_at_block_ends"]
                else ""
            )
            lines.append(f"  recurrent state ({state['kind']}, {state['layers']} layers): "
                         f"{state['bytes_per_sequence'] / 2**10:.0f} KiB a sequence, {state['bytes'] / 2**20:.1f} MiB "
                         f"for {engine['max_batch_size']}{kept}")  # fmt: skip
        if disk := engine.get("kv_disk"):
            lines.append(f"  prefix cache on disk: {disk['directory']}, up to {disk['max_bytes'] / 2**30:.1f} GiB; "
                         f"{disk['blocks']} blocks ({disk['bytes'] / 2**20:.0f} MiB) there now")  # fmt: skip
        for what, why in engine.get("hybrid_limits", {}).items():
            lines.append(f"  {what.replace('_', ' ')} {why}")
        lines.append(f"  batches: up to {engine['max_batch_size']} sequences and "
                     f"{engine['max_num_batched_tokens']} tokens a step")  # fmt: skip
    if "batch_invariant" in engine:
        dense = engine.get("dense_from_rows")
        path = f", dense products from {dense} rows" if dense else ""
        lines.append(f"  batch invariance: {engine['batch_invariant_mode']} -> "
                     f"{'on' if engine['batch_invariant'] else 'off'}{path}")  # fmt: skip
    lines.append(f"  speculative decoding: {facts['speculative']}")
    return "\n".join(lines)
