"""A PaddleFormers LLaMA trained through raydist, tensor parallel by PaddleFormers' own plan.

    pip install -e . paddleformers
    python examples/paddleformers_llama.py [--dp 1 --mp 2] [--dynamic] [--steps 40]

Starts a local Ray, builds a small ``LlamaForCausalLM`` on a dp x mp mesh of Ray ranks
(``--mp``: PaddleFormers' ``auto_dist_config`` tensor-parallel plan; ``--dp``: data
parallel), reads rows of token ids through ``raydist.shard_dataloader`` (each rank
reads its own), and trains with ``fit``: a checkpoint every 10 steps in ``--out``, a
killed rank restarted from it (``max_failures``), and an interrupted run started again
with ``--resume`` going on from the newest one, to the end an uninterrupted run reaches.
``--dynamic`` runs the layer eagerly on the ranks (``to_static(..., dynamic=True)``)
instead of converting it with dy2static.

The rows here are the bytes of a text, so that the example needs no download; with a
real corpus, tokenize it (``AutoTokenizer.from_pretrained(...)``) into rows of
``SEQ + 1`` ids and keep the rest as it is.

On CPU the model must keep PaddleFormers' fused kernels off (``fuse_rms_norm``, flash
attention: they exist on GPUs only); with ``--gpu`` they may go on.

The other way, PaddleFormers' own ``Trainer`` in a plain script, runs through
``raydist launch -n 2 your_trainer_script.py`` as through ``python -m
paddle.distributed.launch --nproc_per_node 2`` (on CPU with ``amp_master_grad=False``
and ``sharding=""`` in its ``TrainingArguments``).
"""

from __future__ import annotations

import argparse

import numpy as np
import paddle
import paddle.distributed as dist

import raydist

SEQ, BATCH = 32, 8
TEXT = (b"raydist runs PaddlePaddle's auto-parallel DistModel on Ray: one actor per rank, "
        b"a driver that sends the batches and gathers the results, and recovery when a rank dies. ") * 40


def config(gpu: bool):
    from paddleformers.transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                       use_single_model_implementation=True, tie_word_embeddings=False, fuse_rms_norm=gpu,
                       use_flash_attention=gpu,
                       fuse_attention_qkv=False, _attn_implementation="eager")  # fmt: skip


class CausalLM(paddle.nn.Layer):
    """Token ids in, logits out: the shape DistModel takes (a loss of (outputs, labels))."""

    def __init__(self, gpu: bool):
        super().__init__()
        from paddleformers.transformers import LlamaForCausalLM

        paddle.seed(7)
        self.lm = LlamaForCausalLM(config(gpu))

    def forward(self, ids):
        return self.lm(input_ids=ids, return_dict=False)[0]


class TokenLoss(paddle.nn.Layer):
    def forward(self, logits, labels):
        return paddle.nn.functional.cross_entropy(logits.reshape([-1, logits.shape[-1]]).astype("float32"),
                                                  labels.reshape([-1, 1]))  # fmt: skip


def tp_plan(layer: CausalLM) -> dict:
    """PaddleFormers' tensor-parallel plan, as 1.2.0 needs it mended: its keys say "llama." where the
    model's decoder is "model.", and its column split of ``lm_head.weight`` (kept [vocab, hidden],
    used with transpose_y) is refused by Paddle's matmul rule, so the head stays whole."""
    plan = layer.lm.auto_dist_config(prefix="lm.")["mp_config"]["parallelize_plan"]
    return {key.replace("lm.llama.", "lm.model."): value for key, value in plan.items() if "lm_head" not in key}


def builder(dp: int, mp: int, gpu: bool):
    """The layer builder: it runs on every rank once the process group exists."""

    def build_layer():
        from paddle.distributed.auto_parallel.intermediate.parallelize import parallelize_model

        layer = CausalLM(gpu)
        ranks = np.arange(dp * mp).reshape(dp, mp)
        mesh = dist.ProcessMesh(ranks.tolist(), dim_names=["dp", "mp"])
        parallel = {"dp_config": {"sharding_level": 0}}
        if mp > 1:
            parallel["mp_config"] = {"parallelize_plan": tp_plan(layer)}
        return parallelize_model(layer, mesh=mesh, config=parallel)

    return build_layer


class TokenRows(paddle.io.Dataset):
    """Rows of SEQ + 1 token ids: the inputs, and the same shifted by one as the labels."""

    def __init__(self, ids: np.ndarray):
        self.rows = np.lib.stride_tricks.sliding_window_view(ids, SEQ + 1)[:: SEQ // 2]

    def __getitem__(self, i):
        row = self.rows[i].astype("int64")
        return {"ids": row[:-1], "labels": row[1:]}

    def __len__(self) -> int:
        return len(self.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--mp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dynamic", action="store_true", help="run the layer eagerly on the ranks")
    parser.add_argument("--gpu", action="store_true", help="one GPU per rank, NCCL, fused kernels")
    parser.add_argument("--out", default="/tmp/raydist-llama", help="where the checkpoints go")
    parser.add_argument("--resume", action="store_true",
                        help="go on with an interrupted run in --out from its newest checkpoint")
    args = parser.parse_args()

    mesh = dist.ProcessMesh(np.arange(args.dp * args.mp).reshape(args.dp, args.mp).tolist(), dim_names=["dp", "mp"])
    rows = TokenRows(np.frombuffer(TEXT, dtype=np.uint8))
    loader = raydist.shard_dataloader(rows, mesh,
                                      input_keys=["ids", "labels"], shard_dims="dp", batch_size=BATCH,
                                      shuffle=True, seed=0)  # fmt: skip
    optimizer = lambda params: paddle.optimizer.AdamW(3e-3, parameters=params)  # noqa: E731 - runs on each rank
    with raydist.to_static(builder(args.dp, args.mp, args.gpu), loader, TokenLoss(), optimizer,
                           num_workers=args.dp * args.mp, use_gpu=args.gpu, dynamic=args.dynamic) as dm:  # fmt: skip
        losses = dm.fit(loader, steps=args.steps, checkpoint_every=10, checkpoint_dir=args.out, max_failures=2,
                        resume=args.resume, keep_last=2)  # fmt: skip
        print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps; checkpoints in {args.out}")
        dm.predict()
        logits = dm(rows.rows[:BATCH, :-1].astype("int64"))  # a global batch, whole
        print("next bytes:", bytes(logits[0].argmax(-1)[:24].astype(np.uint8).tolist()))


if __name__ == "__main__":
    main()
