# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version,-jupytext.text_representation.format_version
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# (tutorial-beyond-the-step)=
# # Evaluation and generation on a sharded model
#
# **What you will learn**
#
# - how FSDP2 evaluates under `torch.no_grad()`: all-gathers per forward with
#   `reshard_after_forward` true and false, what each leaves gathered, and `reshard()`;
# - how to evaluate an eval set that does not split evenly over the ranks, counting every
#   example once, where `DistributedSampler` repeats some;
# - how a sharded model generates token by token, the all-gathers per generated token,
#   the cost of keeping it unsharded instead, and when `register_fsdp_forward_method` is
#   needed.
#
# A second copy of the weights beside the trained model (an EMA, a frozen teacher) has a
# page of its own: {ref}`tutorial-ema-and-teacher`.
#
# **What you need**: a CPU; 2 processes on gloo; about 5 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
# worker code is written to run unchanged with one GPU per rank (NCCL): the shards live on
# {func}`fsdp_guide.device`. The tips it demonstrates are listed
# {ref}`at the end <beyond-the-step-tips>`.
# Its idea as a plain torchrun script to copy: {ref}`beyond-the-step-script` ({download}`download <scripts/beyond_the_step.py>`).

# %%
import sys

import torch

print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")

# %% [markdown]
# The model is the package's small GPT ({class}`fsdp_guide.gpt.GPT`), 2 blocks, each
# block an FSDP unit and the root holding the embeddings (the output head is tied to them).
# `gathers` runs a function and counts FSDP's all-gathers in it, with
# {func}`fsdp_guide.precision.record_dtypes`; `held` is the parameter bytes a rank holds,
# from {func}`fsdp_guide.memory.measure`, in units of *P*, the whole model's parameter
# bytes.

# %%
import fsdp_guide
import torch.distributed as dist
from fsdp_guide import launch
from fsdp_guide.gpt import GPT, GPTConfig
from fsdp_guide.memory import measure
from fsdp_guide.precision import record_dtypes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

CONFIG = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def build_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    model.init_weights()
    return model


def shard_model(model, **kwargs):
    mesh = init_device_mesh(fsdp_guide.device().type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def whole_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gathers(fn):
    """fn's result, and how many all-gathers FSDP ran in it."""
    with record_dtypes() as seen:
        result = fn()
    return result, seen.count[("forward", "all-gather")] + seen.count[("backward", "all-gather")]


def held(model):
    return measure(model).params / whole_bytes(model)


# %% [markdown]
# (beyond-eval)=
# ## Evaluation under `no_grad`
#
# Three evaluation forwards in a row, after `model.eval()` and under `torch.no_grad()`,
# with FSDP2's default (`reshard_after_forward=None`: `True` for the blocks, `False` for
# the root) and with `reshard_after_forward=False` everywhere:
#
# (fsdp2-fsdpmodule-reshard)=


# %%
def reshard_all(model):
    for module in model.modules():  # reshard() does not recurse: each FSDP module frees its own
        if isinstance(module, FSDPModule):
            module.reshard()


def evaluation_forwards(reshard_after_forward):
    device = fsdp_guide.device()
    kwargs = (
        {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    )
    model = shard_model(build_model(), **kwargs)
    model.eval()
    tokens = torch.randint(
        CONFIG.vocab_size, (4, CONFIG.block_size), generator=torch.Generator().manual_seed(1)
    )
    rows = []
    with torch.no_grad():
        for _ in range(3):
            _, count = gathers(lambda: model(tokens.to(device)))
            rows.append((count, held(model)))
    plain = plain_parameters(model)
    reshard_all(model)  # free what evaluation left gathered
    model.train()  # back to training behaviour (dropout, norms) before the next step
    return rows, held(model), (plain, plain_parameters(model))


def plain_parameters(model):
    """How many of model.parameters() are gathered plain tensors, not DTensor shards."""
    return sum(not isinstance(p, DTensor) for p in model.parameters())


def both_settings():
    return {setting: evaluation_forwards(setting) for setting in (None, False)}


from fsdp_guide.table import Table
from IPython.display import display

n_params = len(list(build_model().parameters()))
evaluation = launch(both_settings, output="none")[0]
rows = []
for setting, (forwards, after, (plain, plain_after)) in evaluation.items():
    name = "None (the default)" if setting is None else str(setting)
    counts = " ".join(str(count) for count, _ in forwards)
    held_each = " ".join(f"{h:.2f}" for _, h in forwards)
    rows.append([name, counts, held_each, f"{after:.2f}", plain, plain_after])
print(f"plain: how many of the {n_params} parameters() are gathered tensors, after forward 3")
header = ["reshard_after_forward", "all-gathers per forward", "held / P per forward"]
display(Table([*header, "held / P after reshard()", "plain", "plain after reshard()"], rows))

# the figures the text quotes, from this run (JupyterLab shows glue's roles unrendered)
from myst_nb import glue

glue("bts_eval_default_held", evaluation[None][0][-1][1], display=False)  # after forward 3
glue("bts_eval_shards", evaluation[None][1], display=False)  # after reshard()
glue("bts_eval_kept_held", evaluation[False][0][-1][1], display=False)

# %% [markdown]
# The figures in this text are this run's, taken from the tables by myst-nb's `glue`; in
# JupyterLab, which does not render glue's roles, read them from the table above each paragraph.
#
# - With the default, each forward gathers the 2 blocks again; the root is gathered once
#   and **stays gathered** after the forward ({glue:text}`bts_eval_shards:.2f` *P* of shards plus the root's
#   embeddings and final norm, whole: {glue:text}`bts_eval_default_held:.2f` *P*). In training, the backward reshards it; evaluation has no backward, so
#   it stays until something reshards it: a backward, `reshard()`, or `state_dict()` and
#   `load_state_dict()`, whose hooks reshard first (`FSDPParamGroup._register_state_dict_hooks`
#   in `torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`).
# - With `reshard_after_forward=False`, the first forward gathers all 3 units and later
#   forwards gather nothing, but the rank then holds the whole model beside its shards
#   ({glue:text}`bts_eval_kept_held:.1f` *P*) until `reshard()`.
# - `reshard()` on every FSDP module (it does not recurse: `FSDPModule.reshard` in
#   `torch/distributed/fsdp/_fully_shard/_fully_shard.py`) frees the gathered parameters.
#   Call it after evaluating: the next training step would reuse the gathered root and
#   reshard it in its backward, but whatever runs in between (a checkpoint, generation,
#   an EMA update) would have the memory held, and would see plain gathered tensors where
#   `parameters()` otherwise gives the shards (the last two columns: the root's parameters with
#   the default, all of them with `False`, none after `reshard()`). Then `model.train()`
#   again.
#
# `no_grad` does not change which units FSDP gathers or reshards in the forward: its hooks
# read the grad mode only to skip registering the backward's hooks
# (`FSDPState._register_pre_backward_hook` in `_fsdp_state.py` and
# `FSDPParamGroup._register_post_backward_hook`, same folder). It spares the activations
# autograd would keep for a backward.
#
# (beyond-uneven-eval)=
# ## An eval set that does not split evenly
#
# Nine examples on 2 ranks. `DistributedSampler` (the usual choice) pads the split by
# repeating examples from the start, so that every rank gets the same number; the metric
# then counts those twice. Splitting the examples without padding (every example exactly
# once) gives ranks different numbers of batches, the first hang of
# {ref}`tutorial-debugging-hangs`. Done right: every rank runs the largest number of
# batches any rank has (one `all_reduce` with `MAX`), a rank out of data runs the forward
# on an empty batch (its all-gathers still run; its rows add nothing), and the summed
# losses and token counts are `all_reduce`d once at the end.

# %%
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EVAL_EXAMPLES, EVAL_BATCH = 9, 2


def eval_set():
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(CONFIG.vocab_size, (EVAL_EXAMPLES, CONFIG.block_size + 1), generator=g)
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def summed_loss(model, tokens, targets):
    logits, _ = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def evaluate_one_process():
    model = build_model().eval()
    tokens, targets = eval_set().tensors
    with torch.no_grad():
        return (summed_loss(model, tokens, targets) / targets.numel()).item()


def evaluate(model, loader):
    """Mean loss per token over everything the loader gives every rank; and this rank's batch count."""
    device = fsdp_guide.device()
    most = torch.tensor(len(loader), device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the largest batch count of any rank
    # no rows: the forward, not the data
    empty = [torch.zeros(0, CONFIG.block_size, dtype=torch.long)] * 2
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # summed loss, tokens, examples
    batches = iter(loader)
    with torch.no_grad():
        for _ in range(int(most)):  # the same number of forwards on every rank
            x, y = next(batches, empty)
            # stays on the device: no sync
            totals[0] += summed_loss(model, x.to(device), y.to(device)).double()
            totals[1] += y.numel()
            totals[2] += len(x)
    dist.all_reduce(totals)  # once, at the end
    loss, tokens, examples = totals.tolist()
    return loss / tokens, int(examples), len(loader)


def evaluate_both_ways():
    model = shard_model(build_model()).eval()
    data = eval_set()
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    padded = evaluate(model, DataLoader(data, batch_size=EVAL_BATCH, sampler=sampler))
    exact = evaluate(
        model,
        DataLoader(
            torch.utils.data.Subset(data, range(rank, len(data), world)), batch_size=EVAL_BATCH
        ),
    )
    return {"DistributedSampler (pads)": padded, "every example once": exact}


results = launch(evaluate_both_ways, output="none")
rows = [["one process", f"{evaluate_one_process():.6f}", EVAL_EXAMPLES, "1"]]
for name, (loss, examples, _) in results[0].items():
    batches = ", ".join(str(r[name][2]) for r in results)
    rows.append([name, f"{loss:.6f}", examples, batches])
display(Table(["evaluation", "loss", "examples", "batches per rank"], rows))
glue("bts_padded_examples", results[0]["DistributedSampler (pads)"][1], display=False)
glue("bts_exact_examples", results[0]["every example once"][1], display=False)

# %% [markdown]
# `DistributedSampler` evaluated {glue:text}`bts_padded_examples` examples, one of them twice, and its loss differs from
# one process's; splitting without padding counts each of the {glue:text}`bts_exact_examples` once and gives one
# process's loss (to the float32 rounding of the sums), though one rank had a batch fewer
# (the table's batches per rank).
# The empty batch ran through PyTorch's own attention (`scaled_dot_product_attention`) here;
# with an attention kernel that rejects zero rows, run one real row instead, with its loss
# and count multiplied by zero.
# `DistributedSampler(drop_last=True)` would instead drop the ninth example (it trims the
# indices to a multiple of the ranks: `DistributedSampler.__iter__` in
# `torch/utils/data/distributed.py`). The metric is
# the summed loss over the summed count, never the mean of the ranks' means (see
# {ref}`tutorial-loss-and-accumulation`).
#
# (beyond-generation)=
# ## Generating token by token
#
# {meth}`fsdp_guide.gpt.GPT.generate` appends one token per forward. Each rank generates
# from its own prompt (data-parallel generation), greedily; one process generates from both
# prompts for comparison. Every forward gathers what the previous one resharded:
#
# (fsdp2-fsdpmodule-set-reshard-after-forward)=

# %%
PROMPT, NEW_TOKENS = 8, 6


def prompts():
    return torch.randint(CONFIG.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(3))


def generate_sharded(keep_gathered):
    device = fsdp_guide.device()
    model = shard_model(build_model()).eval()
    prompt = prompts()[dist.get_rank()][None].to(device)
    if keep_gathered:  # gather once, then hold the whole model until reshard()
        model.set_reshard_after_forward(False)
    out, count = gathers(lambda: model.generate(prompt, NEW_TOKENS, temperature=0))
    during = held(model)
    reshard_all(model)
    if keep_gathered:  # back to the default for training: the blocks reshard, the root does not
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)
    return out[0].tolist(), count, during


def generation_both_ways():
    return {keep: generate_sharded(keep) for keep in (False, True)}


one_process = build_model().eval().generate(prompts(), NEW_TOKENS, temperature=0).tolist()
results = launch(generation_both_ways, output="none")
rows = []
for keep in (False, True):
    _, count, during = results[0][keep]
    same = all(results[rank][keep][0] == one_process[rank] for rank in (0, 1))
    name = "kept gathered (reshard_after_forward=False)" if keep else "resharded after each forward"
    rows.append([name, count, f"{count / NEW_TOKENS:.2f}", f"{during:.2f}", same])
header = ["generation", "all-gathers", "per new token", "held / P", "tokens as one process"]
display(Table(header, rows))
glue("bts_generation_kept_held", results[0][True][2], display=False)
glue("bts_generation_gathers", results[0][False][1], display=False)
glue("bts_new_tokens", NEW_TOKENS, display=False)

# %% [markdown]
# Resharding after each forward, the first forward gathers all 3 units and each later one
# the 2 blocks again (the root stays gathered, as in evaluation): {glue:text}`bts_generation_gathers` all-gathers for {glue:text}`bts_new_tokens`
# tokens, 3 + 2 per forward after the first, though each input is one token longer than
# the last (FSDP gathers per unit run, whatever the input). Kept gathered, the 3 units are
# gathered once and the rank holds the whole model beside its shard ({glue:text}`bts_generation_kept_held:.1f` *P*) while it generates. What the
# gathers cost in time is not measured here (CPU ranks on one machine). On GPUs each
# all-gather per token is expected to add a collective's latency to a decoding step that
# otherwise does little work, and a KV cache would shrink the step's compute, not the count
# of gathers; so for more than a few tokens the model is meant to be kept gathered when it
# fits. Afterwards `reshard()`, and restore the training setting
# (`set_reshard_after_forward` stays set until changed).
#
# Every rank must run the same number of forwards: a rank that stops at its end-of-sequence
# token while another continues hangs in the next all-gather. Hugging Face's `generate`
# has `synced_gpus=True` for this (finished ranks keep running forwards until all are done,
# at one small all-reduce per token: `GenerationMixin._has_unfinished_sequences` in
# `transformers/generation/utils.py`); transformers 5.24 turns it on by itself with more than
# one rank under DeepSpeed ZeRO-3 or for a model FSDP manages: `is_fsdp_managed_module` in
# `transformers/distributed/fsdp.py` looks for the `_is_fsdp_managed_module` flag, which
# torch's `fully_shard` sets on every module it manages (`torch/distributed/fsdp/_fully_shard/_fully_shard.py`),
# and for FSDP1's wrapper. Passing it yourself costs nothing and does not depend on that
# flag. Here every rank generates exactly `NEW_TOKENS`.
#
# ### A method other than forward: a DTensor mixed with a plain torch.Tensor
#
# `generate` needed nothing from FSDP because it calls the model itself (`self(...)`), so
# FSDP's pre-forward and post-forward hooks run. A method that uses a unit's parameters
# without going through that unit's `forward` (here the root's embeddings) does not gather
# them; such methods are registered with `register_fsdp_forward_method`:
#
# (fsdp2-register-fsdp-forward-method)=

# %%
from torch.distributed.fsdp import register_fsdp_forward_method


class GPTWithFeatures(GPT):
    def features(self, idx):
        """The final hidden states: a second entry point, as `get_text_features` is."""
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def features_sharded(register):
    device = fsdp_guide.device()
    torch.manual_seed(0)
    model = GPTWithFeatures(CONFIG)
    model.init_weights()
    shard_model(model)
    if register:
        register_fsdp_forward_method(model, "features")
    with torch.no_grad():
        return model.features(prompts()[:1].to(device)).shape


for register in (False, True):
    try:
        print(
            f"register_fsdp_forward_method: {register!s:5} -> features of shape",
            tuple(launch(features_sharded, register, output="none")[0]),
        )
    except fsdp_guide.LaunchError as error:  # "rank N raised ...": whichever rank failed first
        print(
            f"register_fsdp_forward_method: {register!s:5} ->",
            str(error).splitlines()[0].split(" raised ")[1].split(", need")[0],
        )

# %% [markdown]
# Unregistered, the root's embedding weight is still a sharded `DTensor` when `features`
# uses it, and the embedding fails on the mix of a DTensor and a plain tensor; registered,
# FSDP gathers the root before the method and the blocks gather themselves as usual. The
# failure depends on state: after a default forward the root stays gathered (as above), and
# the unregistered method runs, until the next backward or `reshard()`. Register it rather
# than rely on that.

# %% [markdown]
# (beyond-the-step-script)=
# ## The script to copy
#
# This page's idea as a plain torchrun script, with torch alone: {download}`scripts/beyond_the_step.py`.
# It evaluates a sharded model on 9 examples split unevenly over 2 ranks, each example once,
# every rank running as many forwards as the rank with the most batches (an empty batch where its
# data has run out) and the summed losses and token counts all-reduced once at the end; rank 0
# prints the batches per rank, the examples counted and the difference from one process's loss
# over the whole set. The tests run this file under torchrun on 2 CPU ranks and check that every
# example counted once and that the difference is at most 1e-5 (`tests/test_scripts.py`).
#
# ```{literalinclude} scripts/beyond_the_step.py
# :language: python
# ```

# %% [markdown]
# (beyond-the-step-tips)=
# ## The tips behind this
#
# - {ref}`tip-eval-reshard`
# - {ref}`tip-generation-gathers`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("beyond_the_step")
