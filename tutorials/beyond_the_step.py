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
# # Beyond the training step: evaluation, generation, EMA and a frozen teacher
#
# **What you will learn**
#
# - how FSDP2 evaluates under `torch.no_grad()`: all-gathers per forward with
#   `reshard_after_forward` true and false, what each leaves gathered, and `reshard()`;
# - how to evaluate an eval set that does not split evenly over the ranks, counting every
#   example once, where `DistributedSampler` repeats some;
# - how a sharded model generates token by token, the all-gathers per generated token,
#   the cost of keeping it unsharded instead, and when `register_fsdp_forward_method` is
#   needed;
# - how to keep an exponential moving average (EMA) of a sharded model on the shards, with
#   no communication, equal to one process's, and how to export it;
# - what a frozen teacher (or reference) model costs beside the trained one, sharded.
#
# **What you need**: a CPU; 2 processes on gloo; about 10 seconds on 2 CPU cores ({ref}`measured <measured-times>`). The
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
from fsdp_guide.compare import largest_difference
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


n_params = len(list(build_model().parameters()))
print(
    f"{'reshard_after_forward':24} {'all-gathers in forward 1, 2, 3':>32} {'held / P after each':>22} "
    f"{'after reshard()':>16}   plain tensors among the {n_params} parameters(): after forward 3, after reshard()"
)
evaluation = launch(both_settings, output="none")[0]
for setting, (rows, after, (plain, plain_after)) in evaluation.items():
    name = "None (the default)" if setting is None else str(setting)
    print(
        f"{name:24} {' '.join(f'{c:3}' for c, _ in rows):>32} {' '.join(f'{h:.2f}' for _, h in rows):>22} "
        f"{after:16.2f}   {plain:3} {plain_after:3}"
    )

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
#   `parameters()` otherwise gives the shards (the last column: the root's parameters with
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


print(f"{'one process':28} loss {evaluate_one_process():.6f} over {EVAL_EXAMPLES} examples")
results = launch(evaluate_both_ways, output="none")
for name, (loss, examples, _) in results[0].items():
    batches = [r[name][2] for r in results]
    print(f"{name:28} loss {loss:.6f} over {examples} examples, batches per rank {batches}")
glue("bts_padded_examples", results[0]["DistributedSampler (pads)"][1], display=False)
glue("bts_exact_examples", results[0]["every example once"][1], display=False)

# %% [markdown]
# `DistributedSampler` evaluated {glue:text}`bts_padded_examples` examples, one of them twice, and its loss differs from
# one process's; splitting without padding counts each of the {glue:text}`bts_exact_examples` once and gives one
# process's loss (to the float32 rounding of the sums), though one rank had a batch fewer
# (the batches per rank, printed).
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
print(
    f"{'':44} {'all-gathers':>11} {'per new token':>13} {'held / P':>9} {'tokens as one process':>22}"
)
for keep in (False, True):
    _, count, during = results[0][keep]
    same = all(results[rank][keep][0] == one_process[rank] for rank in (0, 1))
    name = "kept gathered (reshard_after_forward=False)" if keep else "resharded after each forward"
    print(f"{name:44} {count:11} {count / NEW_TOKENS:13.2f} {during:9.2f} {str(same):>22}")
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
#
# (beyond-ema)=
# ## An EMA of a sharded model
#
# An exponential moving average ({term}`EMA`) is elementwise: `ema = decay * ema + (1 - decay) * param`.
# Kept as a copy of each parameter's **shard** (the `DTensor`s FSDP2 registers), it needs
# no communication and costs *P*/*N* per rank. torch's `AveragedModel` deep-copies the model,
# which FSDP refuses for a sharded one:

# %%
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

DECAY, STEPS = 0.9, 8


def averaged_model_of_sharded():
    model = shard_model(build_model())
    AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))


try:
    launch(averaged_model_of_sharded, output="none")
except fsdp_guide.LaunchError as error:  # "rank N raised ...": whichever rank failed first
    print("a rank raised", str(error).splitlines()[0].split(" raised ", 1)[1])

# %% [markdown]
# Here the EMA is a second model, built and sharded as the
# trained one, frozen, and started from a copy of the model's shards (also right for a model
# loaded from a checkpoint). Its parameters are `DTensor` shards laid out like the model's,
# updated after every optimizer step with `AveragedModel`'s update (`get_ema_multi_avg_fn`,
# a `torch._foreach_lerp_` over the two lists of shards: `torch/optim/swa_utils.py`).
# torch's `CommDebugMode` counts the collectives the updates run, including any a `DTensor`
# operation would run inside.
# Being a model, the EMA is exported like one: `get_model_state_dict` gathers it whole for
# one file (tied weights under both names); its shards go into a DCP checkpoint as the
# model's do ({ref}`tutorial-llm`). One process runs the same function on the whole model,
# for the same steps on the same global batches:

# %%
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor.debug import CommDebugMode


@torch.no_grad()
def copy_of(model, ema_model):
    """ema_model, frozen, holding a copy of model's parameters (shard by shard when sharded)."""
    ema_model.requires_grad_(False)
    for ema, param in zip(ema_model.parameters(), model.parameters()):
        ema.copy_(param.detach())
    return ema_model


def train_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    rows = torch.randint(CONFIG.vocab_size, (4, CONFIG.block_size + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def train_with_ema(model, ema_model, device, rows=slice(None)):
    """Train STEPS steps, updating ema_model after each; the number of collectives the updates ran."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    update = get_ema_multi_avg_fn(DECAY)
    ema_collectives = 0
    for step in range(STEPS):
        tokens, targets = train_batch(step)
        _, loss = model(tokens[rows].to(device), targets[rows].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with CommDebugMode() as comm:
            update(list(ema_model.parameters()), list(model.parameters()), step)
        ema_collectives += comm.get_total_counts()
    return ema_collectives


def ema_sharded():
    device = fsdp_guide.device()
    model = shard_model(build_model())
    ema_model = copy_of(model, shard_model(build_model()))  # the same layout, the model's values
    # this rank's half of each global batch
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    ema_collectives = train_with_ema(model, ema_model, device, rows)
    per_rank = measure(ema_model).total / whole_bytes(ema_model)
    # whole tensors, on rank 0's CPU
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full, trained = (
        get_model_state_dict(ema_model, options=options),
        get_model_state_dict(model, options=options),
    )
    return (full, trained) if dist.get_rank() == 0 else None, ema_collectives, per_rank


one = build_model()
one_ema = copy_of(one, build_model())
train_with_ema(one, one_ema, torch.device("cpu"))  # cpu-only: the reference runs here
(exported, trained), ema_collectives, per_rank = launch(ema_sharded, output="none")[0]


def apart(full, reference):
    return largest_difference((full[name], t) for name, t in reference.state_dict().items())


print(
    f"collectives in {STEPS} EMA updates: {ema_collectives}; EMA model per rank: {per_rank:.2f} P"
)
print(f"trained model vs one process's: largest difference {apart(trained, one):.1e}")
print(f"exported EMA vs one process's:  largest difference {apart(exported, one_ema):.1e}")

import tempfile
from pathlib import Path

scratch = tempfile.TemporaryDirectory()  # deleted, with what the page wrote, when the kernel exits
path = Path(scratch.name) / "ema.pt"
torch.save(exported, path)  # rank 0's export, loaded into a plain model:
plain = build_model()
print("loads into a plain GPT:", plain.load_state_dict(torch.load(path)))

# one EMA update at decay 0.999, from 1 towards 2, in each dtype
one, two = (torch.tensor(1.0), torch.tensor(2.0))
print(
    f"one update at decay 0.999 from 1 towards 2: {torch.lerp(one, two, 1 - 0.999).item():.4f} in fp32, "
    f"{torch.lerp(one.bfloat16(), two.bfloat16(), 1 - 0.999).item():.4f} in bf16"
)

# %% [markdown]
# The EMA updates ran no collective. The EMA model
# holds half of the model per rank, parameters only, and after 8 steps equals the EMA one
# process computes as closely as the trained models agree with each other (the two
# differences printed above): an elementwise rule on shards is the same rule on the whole. The export is a plain state dict, with the tied
# head under both names, which a plain `GPT` loads with no missing or unexpected key.
#
# Two cautions. While a unit is gathered, `parameters()` gives its whole plain tensors, not
# the shards (the evaluation table's last column): `reshard()` the EMA model after
# evaluating it (and the model before updating the EMA), or the update mixes tensors and
# `DTensor`s, or updates a gathered copy that resharding then drops. And the EMA's dtype is
# its parameters': under a `MixedPrecisionPolicy` the sharded parameters keep their
# original dtype, fp32 for a model stored in fp32 (`param_dtype` applies to the unsharded
# ones: the `MixedPrecisionPolicy` docstring in
# `torch/distributed/fsdp/_fully_shard/_fsdp_api.py`), so the EMA does; a model stored in
# bf16 needs its EMA kept in fp32. With a decay of 0.999 an update moves the EMA by a
# thousandth of its distance to the parameter, which bf16's 8 significant bits round away
# unless the distance is comparable to the value itself (the last line above).
#
# (beyond-teacher)=
# ## A frozen teacher beside the student
#
# Distillation, or a reference model in preference training, runs a second model forward
# only. Sharded like the student, with its parameters frozen ({term}`frozen parameter`), it holds *P*/*N* per rank and
# no gradients or optimizer state. Its root unit is what to watch: with the default it
# stays gathered after every forward, and a teacher never runs a backward to reshard it.


# %%
def distillation_step(teacher_reshard_root):
    device = fsdp_guide.device()
    student = shard_model(build_model(seed=0))
    teacher = build_model(seed=1).requires_grad_(False).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in teacher.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=teacher_reshard_root)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    tokens, _ = train_batch(0)
    tokens = tokens[2 * dist.get_rank() : 2 * dist.get_rank() + 2].to(device)

    def student_step(teacher_logits):
        logits, _ = student(tokens)
        loss = F.kl_div(
            F.log_softmax(logits.float(), -1),
            F.log_softmax(teacher_logits.float(), -1),
            log_target=True,
            reduction="batchmean",
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    counts = []
    for _ in range(2):  # the second step shows the steady state
        with torch.no_grad():
            (teacher_logits, _), teacher_gathers = gathers(lambda: teacher(tokens))
        _, student_gathers = gathers(lambda: student_step(teacher_logits))  # noqa: B023 (called here)
        counts.append((teacher_gathers, student_gathers))
    P = whole_bytes(student)
    return {
        "teacher": ([t for t, _ in counts], measure(teacher).total / P),
        "student": ([s for _, s in counts], measure(student, optimizer).total / P),
    }


def both_teachers():
    return {setting: distillation_step(setting) for setting in (None, True)}


print(f"{'teacher root':28} {'':8} {'all-gathers in step 1, 2':>25} {'model states held / P':>22}")
teachers = launch(both_teachers, output="none")[0]
for setting, parts in teachers.items():
    for who, (counts, states) in parts.items():
        name = "default" if setting is None else "reshard_after_forward=True"
        print(f"{name:28} {who:8} {' '.join(f'{c:3}' for c in counts):>25} {states:22.2f}")
glue("bts_student_held", teachers[None]["student"][1], display=False)
glue("bts_teacher_default_held", teachers[None]["teacher"][1], display=False)
glue("bts_teacher_resharded_held", teachers[True]["teacher"][1], display=False)

# %% [markdown]
# The student, trained with AdamW, holds {glue:text}`bts_student_held:.1f` *P* per rank after its step: half its
# parameters and half of each of AdamW's two moments (`zero_grad()` has freed the
# gradients). The teacher holds parameters only. Its root is the choice:
#
# - with the default, the root stays gathered after the teacher's forward and through the
#   student's whole step ({glue:text}`bts_teacher_default_held:.2f` *P*: its shards and the root's embeddings, whole), and the
#   next step's teacher forward gathers only the 2 blocks;
# - with `reshard_after_forward=True` passed to the teacher's root, the teacher holds its
#   shards only ({glue:text}`bts_teacher_resharded_held:.2f` *P*), and pays one more all-gather, the root's, per step.
#
# Left unsharded (a plain module on every rank, not given to `fully_shard`), the teacher
# would hold 1 *P* on every rank and run no collective; replicated *with* FSDP (a shard
# group of one rank) it would hold that 1 *P* as its shards and more while it runs, FSDP
# copying each unit into an unsharded buffer at every forward (measured, for a model kept
# gathered from forward to backward, in the {ref}`frozen weights tutorial <lora-traffic>`). `no_grad` keeps the
# teacher out of autograd: no activations saved for it, no backward, so no backward
# all-gathers, gradients or reduce-scatters (the student's step above ran its own 5
# all-gathers and none of the teacher's). `requires_grad_(False)` keeps its parameters out of
# the optimizer and gradient-free; it is not a substitute for `no_grad` when the teacher's
# inputs require gradients (the student's hidden states, soft prompts): its outputs then
# require gradients too, autograd saves the teacher's activations, and FSDP registers the
# hooks that gather its units again in backward (`FSDPState._register_pre_backward_hook` in
# `torch/distributed/fsdp/_fully_shard/_fsdp_state.py`).

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
# - {ref}`tip-ema-on-shards`
# - {ref}`tip-frozen-teacher`

# %% tags=["remove-input"]
from fsdp_guide import executed_on

executed_on("beyond_the_step")
