"""The retrieval model's training windows (code carrying ``retrieval_tasks`` or ``retrieval_families`` instances,
the retrieved values' bytes weighted in the loss) and the dense retrieval evaluation that ``train_small_lm.py``
runs after training and on saved checkpoints."""

from __future__ import annotations

import torch


def answer_weight_at(seq_len: int, answer_weight: float) -> float:
    """The loss weight of one retrieved value byte: ``answer_weight`` per 4K of context, so the answers' share of
    a window's loss does not shrink as windows grow (at 64K, 32 answer bytes are otherwise 0.05% of it)."""
    return max(1.0, answer_weight * seq_len / 4096)


def extra_lookups_at(seq_len: int, per_64k: float, rng) -> int:
    """How many extra lookups a training window of ``seq_len`` bytes carries: ``per_64k`` per 64K bytes, the
    fraction rounded at random (no draw when ``per_64k`` is 0, so earlier runs' streams are unchanged)."""
    if per_64k <= 0:
        return 0
    mean = per_64k * seq_len / 65536
    return int(mean) + (rng.random() < mean - int(mean))


def _retrieval_batches(train: bytes, seq_len: int, batch: int, rng, task_share: float, device,
                       styles=("vkey",), answer_weight: float = 0.0, task_weights=None, extra_lookups: float = 0.0,
                       extra_list_share: float = 0.0, extra_near_miss_share: float = 0.0, families=None):
    """Like ``train_small_lm._batches``, but each window is, with probability ``task_share``, a retrieval instance
    (``retrieval_tasks.py``, a random task in a random one of ``styles``) built on that window's code; built on the
    host while the GPU runs the last step. Returns (x, y, per-target loss weights or None): with
    ``answer_weight`` > 0 the bytes of retrieved values weigh ``answer_weight_at(seq_len, answer_weight)``.
    ``task_weights`` (one per ``retrieval_tasks.TASKS``): how often each task is drawn (None: uniformly).
    ``extra_lookups``: lookups added to each instance per 64K bytes (``extra_lookups_at``), a share
    ``extra_list_share`` of them three-value lists, near-miss keys in a share ``extra_near_miss_share`` of the
    windows; their values weighted like the task's. ``families`` (names of ``retrieval_families.FAMILIES``): the
    instances are of a random one of these families instead, with 3 queries plus ``extra_lookups`` per 64K over
    twice as many keys (tasks, styles and the list and near-miss shares unused)."""
    import retrieval_families as rf
    import retrieval_tasks as rt

    rows = []
    weights = torch.ones(batch, seq_len) if answer_weight > 0 else None
    heavy = answer_weight_at(seq_len, answer_weight)
    for row in range(batch):
        start = rng.randrange(0, len(train) - seq_len - 2)
        window = train[start:start + seq_len + 1]
        if families and rng.random() < task_share:
            # extra lookups become more queries: the 3 of an evaluation prompt plus extra_lookups per 64K
            queries = 3 + extra_lookups_at(seq_len, extra_lookups, rng)
            family = rng.choices(families, weights=rf.training_weights(families))[0]
            instance = rf.make_instance(family, window, seq_len + 1, rng, queries)
            rows.append(instance.tokens)
            if weights is not None:
                for answer in instance.answers:
                    weights[row, answer.start - 1:answer.end - 1] = heavy
        elif not families and rng.random() < task_share:
            # uniform draws keep rng.choice: the stream then matches runs from before task weights existed
            task = rng.choice(rt.TASKS) if task_weights is None else rng.choices(rt.TASKS, weights=task_weights)[0]
            # one style draws nothing: the stream then matches runs from before styles existed
            style = styles[0] if len(styles) == 1 else rng.choice(styles)
            instance = rt.make_instance(task, window, seq_len + 1, rng, style,
                                        extra_lookups_at(seq_len, extra_lookups, rng), extra_list_share,
                                        extra_near_miss_share)
            rows.append(instance.tokens)
            if weights is not None:
                for answer in instance.answers:  # target t predicts token t + 1
                    weights[row, answer.start - 1:answer.end - 1] = heavy
        else:
            rows.append(torch.frombuffer(bytearray(window), dtype=torch.uint8))
    data = torch.stack(rows)
    if device.type == "cuda":  # a pageable copy would wait for the GPU: pinned, the host builds ahead
        data = data.pin_memory()
        weights = weights.pin_memory() if weights is not None else None
    data = data.to(device, non_blocking=True).long()
    if weights is not None:
        weights = weights.to(device, non_blocking=True)
    return data[:, :-1], data[:, 1:], weights


@torch.no_grad()
def evaluate_retrieval(model, heldout: bytes, lengths, per_task: dict, seed: int, amp: bool, device,
                       styles=("vkey",)) -> dict:
    """Dense retrieval accuracy on held-out instances: per length and task, the share of values retrieved exactly
    (teacher-forced argmax, ``retrieval_tasks.score``) and of value bytes, in the ``vkey`` style; with more
    ``styles``, also each other style's mean over the tasks (half as many instances)."""
    import random

    import retrieval_tasks as rt

    def accuracy(task, count, rng, style):
        results = []
        for inst in rt.make_batch([task] * count, heldout, length, rng, style):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(inst.tokens[None].to(device).long())[0]
            results += rt.score(logits.float(), inst)
        return results

    model.eval()
    out = {}
    for length in lengths:
        rng = random.Random(seed * 1_000_003 + length)
        rows = {}
        for task in rt.TASKS:
            results = accuracy(task, per_task.get(length, 4), rng, "vkey")
            rows[task] = {"exact": sum(r["exact"] for r in results) / len(results),
                          "chars": sum(r["chars"] for r in results) / len(results), "values": len(results)}
        rows["mean_exact"] = sum(rows[t]["exact"] for t in rt.TASKS) / len(rt.TASKS)
        for style in styles:
            if style != "vkey":
                results = [r for task in rt.TASKS
                           for r in accuracy(task, max(1, per_task.get(length, 4) // 2), rng, style)]
                rows[f"style_{style}"] = sum(r["exact"] for r in results) / len(results)
        out[str(length)] = rows
        print(f"retrieval at {length}: " + ", ".join(f"{t} {rows[t]['exact']:.2f}" for t in rt.TASKS) +
              "".join(f", {k} {v:.2f}" for k, v in rows.items() if k.startswith("style_")), flush=True)
    model.train()
    return out


@torch.no_grad()
def evaluate_families(model, heldout: bytes, lengths, per_family: int, seed: int, amp: bool, device) -> dict:
    """Dense retrieval accuracy on held-out code per length: the share of values retrieved exactly over the
    training families (``family_train``), over the held-out ones (``family_heldout``, formats never trained on)
    and per family (``family.<name>``); ``per_family`` instances per family and length (3 queries each from 16K)."""
    import random

    import retrieval_families as rf
    import retrieval_tasks as rt

    model.eval()
    out = {}
    for length in lengths:
        rng = random.Random(seed * 1_000_003 + length + 17)
        results = []
        for name in rf.FAMILIES:
            for inst in rf.make_batch([name] * per_family, heldout, length, rng):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    logits = model(inst.tokens[None].to(device).long())[0]
                results += [dict(r, split=inst.style) for r in rt.score(logits.float(), inst)]
        rows = {}
        for split in ("train", "heldout"):
            mine = [r["exact"] for r in results if r["split"] == split]
            rows[f"family_{split}"] = sum(mine) / len(mine)
        for name in rf.FAMILIES:
            mine = [r["exact"] for r in results if r["task"] == name]
            rows[f"family.{name}"] = sum(mine) / len(mine)
        out[str(length)] = rows
        print(f"families at {length}: training {rows['family_train']:.2f}, held-out {rows['family_heldout']:.2f}; "
              + ", ".join(f"{n} {rows[f'family.{n}']:.2f}" for n in rf.FAMILIES), flush=True)
    model.train()
    return out
