"""sync_grads on a bare module (the non-DDP path): frozen, unfrozen and unused parameters; fresh
gradient tensors every step with accumulation over several backward calls and shared weights.

Every scenario trains a few steps on real gloo processes and compares, step by step, the reduced
gradients with a single-process reference on the same global batch (each rank's loss computed as
that rank computed it, so a branch used on one rank only counts once, averaged with zeros — DDP's
semantics), then the replicas with each other parameter by parameter.
"""

import pytest
import torch
from torch import nn

import polyparallel as pp

pytestmark = [pytest.mark.multiprocess]

STEPS = 6
ROWS = 4  # per rank


class Net(nn.Module):
    """backbone -> head, plus a branch used on some ranks at some steps and a layer never used.
    ``branch.weight`` (64 floats) and ``backbone.weight`` (48) are larger than a 0.0001 MB bucket,
    so they are reduced alone; the other tensors share flat buckets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.backbone = nn.Linear(6, 8)
        self.head = nn.Linear(8, 1)
        self.branch = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.backbone(x))
        y = self.head(h)
        if use_branch:
            y = y + 0.1 * self.branch(h).sum(-1, keepdim=True)
        return y


class UsedNet(Net):
    """Net without the layer nobody uses: at the step where only some ranks use the branch, those
    ranks have every gradient (and reduce all buckets at once) while the others miss the branch's
    (and reduce bucket by bucket): both must run the same collectives."""

    def __init__(self) -> None:
        super().__init__()
        del self.unused


def frozen(step: int) -> bool:
    return step < 2  # the backbone is unfrozen after two steps (fine-tuning)


def uses_branch(coord: int, step: int) -> bool:
    return (step == 3 and coord % 2 == 0) or step == 5  # some ranks only, then nobody, then all


def batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(STEPS, world * ROWS, 6, generator=g), torch.randn(STEPS, world * ROWS, 1, generator=g)


def _set_frozen(params: list[nn.Parameter], value: bool) -> None:
    for p in params:
        p.requires_grad_(not value)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # a collective over the tensor group: every rank calls it alike
        out[name] = None if g is None else g.detach().clone()
    return out


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def train_distributed(strategy: pp.Strategy, model: nn.Module, frozen_params: list[nn.Parameter],
                      coord: int, world: int) -> dict:
    """The loop every rank runs; gradients recorded after each sync."""
    xs, ys = batches(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)  # fresh tensors, then gradients zeroed in place
        _set_frozen(frozen_params, frozen(step))
        rows = slice(coord * ROWS, (coord + 1) * ROWS)
        nn.functional.mse_loss(model(xs[step, rows], uses_branch(coord, step)), ys[step, rows]).backward()
        strategy.sync_grads(model)
        steps.append(_grads(model))
        opt.step()
    return {"grads": steps, "params": _params(model)}


def train_reference(model: nn.Module, frozen_params: list[nn.Parameter], world: int) -> dict:
    xs, ys = batches(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _set_frozen(frozen_params, frozen(step))
        loss = sum(nn.functional.mse_loss(model(xs[step, r * ROWS:(r + 1) * ROWS], uses_branch(r, step)),
                                          ys[step, r * ROWS:(r + 1) * ROWS]) for r in range(world)) / world
        loss.backward()
        steps.append(_grads(model))
        opt.step()
    return {"grads": steps, "params": _params(model)}


def check_against_reference(results: list[dict], reference: dict, label: str) -> None:
    for step, want in enumerate(reference["grads"]):
        for rank, got in enumerate(r["grads"][step] for r in results):
            for name, w in want.items():
                g = got[name]
                where = f"{label}: step {step}, rank {rank}, {name}"
                if w is None:
                    # unused on every rank, or frozen: no gradient at all (not zeros)
                    assert g is None, f"{where}: expected no gradient, got {g}"
                else:
                    assert g is not None, f"{where}: gradient missing"
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=where)
    for rank, r in enumerate(results):
        for name, w in reference["params"].items():
            torch.testing.assert_close(r["params"][name], w, rtol=1e-5, atol=1e-6, msg=f"{label}: rank {rank} {name}")
            # replicas hold bitwise the same values: every rank applied the same reduced gradients
            assert torch.equal(r["params"][name], results[0]["params"][name]), f"{label}: replicas differ at {name}"


# -- fresh gradients, accumulation, shared weights ------------------------------------------------------
MICRO = 2  # backward calls per step before sync_grads (gradient accumulation)


class SharedNet(nn.Module):
    """Every parameter used on every rank (the path that packs fresh gradients): runs of same-shape
    tensors, a 0-d parameter, a layer applied twice (its gradient is produced twice in one
    backward) and a float64 layer (a bucket of another dtype)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.shared = nn.Linear(4, 4)
        self.wide = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.extra = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = torch.tanh(self.shared(torch.tanh(self.shared(x))))
        x = x + self.extra(x.double()).float()
        return self.head(torch.tanh(self.wide(x))) * self.scale


def fresh_batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(13)
    return (torch.randn(STEPS, world * MICRO * ROWS, 4, generator=g),
            torch.randn(STEPS, world * MICRO * ROWS, 1, generator=g))


def _rows(rank: int, micro: int) -> slice:
    start = (rank * MICRO + micro) * ROWS
    return slice(start, start + ROWS)


def train_fresh_distributed(strategy: pp.Strategy, coord: int, world: int) -> dict:
    model = SharedNet()
    xs, ys = fresh_batches(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step != 3)  # fresh tensors, except one step zeroed in place
        for micro in range(MICRO):  # accumulate over several backward calls, then sync once
            nn.functional.mse_loss(model(xs[step, _rows(coord, micro)]), ys[step, _rows(coord, micro)]).backward()
        strategy.sync_grads(model)
        steps.append(_grads(model))
        opt.step()
    return {"grads": steps, "params": _params(model)}


def train_fresh_reference(world: int) -> dict:
    model = SharedNet()
    xs, ys = fresh_batches(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(xs[step, _rows(r, m)]), ys[step, _rows(r, m)])
                   for r in range(world) for m in range(MICRO)) / world
        loss.backward()
        steps.append(_grads(model))
        opt.step()
    return {"grads": steps, "params": _params(model)}


def test_packing_fresh_gradients_matches_each_gradient():
    """The fresh-gradient packing (torch.stack per run of one shape, then one copy for the rest)
    writes every gradient into its own view, also for gradients stack cannot take directly."""
    from polyparallel_torch.grads import _Layout

    shapes = [(3, 2), (5,), (3, 2), (), (3, 2), (), (2, 3), (5,), (7,)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    (bucket,) = _Layout(params, 1 << 20).buckets
    assert [len(range(a, b)) for a, b, _ in bucket.runs] == [2, 3, 2] and len(bucket.singles) == 2
    torch.manual_seed(0)
    cases = {
        "contiguous": lambda p: torch.randn(p.shape),
        "non-contiguous": lambda p: torch.randn(tuple(reversed(p.shape))).T if p.dim() == 2 else torch.randn(p.shape),
        "requiring grad (create_graph=True)": lambda p: torch.randn(p.shape, requires_grad=True) * 1,
    }
    for label, make in cases.items():
        grads = [make(p) for p in bucket.params]
        bucket.pack(grads)
        for g, v in zip(grads, bucket.views):
            assert torch.equal(v, g.detach()), label


def test_fill_tells_fresh_gradients_from_buffer_views():
    """Fresh gradients are told from the buffer's own views by the first gradient alone; a mix of
    both (a view anywhere: first, inside a run of one shape, a single) still lands every gradient
    in its own view."""
    from polyparallel_torch.grads import _Layout

    shapes = [(3, 2), (5,), (3, 2), (), (3, 2)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    (bucket,) = _Layout(params, 1 << 20).buckets
    in_run = [i for start, end, _ in bucket.runs for i in range(start, end)]
    torch.manual_seed(0)
    want = [torch.randn(p.shape) for p in bucket.params]
    cases = {"all fresh": set(), "all views": set(range(len(want))), "the first a view": {0},
             "one in a run a view": {in_run[1]}, "a single a view": {bucket.singles[-1]}}
    for label, as_view in cases.items():
        bucket.flat.fill_(float("nan"))
        grads = []
        for i, (w, v) in enumerate(zip(want, bucket.views)):
            grads.append(v.copy_(w) if i in as_view else w.clone())
        _Layout._fill(bucket, grads, all_present=True)
        for i, (w, v) in enumerate(zip(want, bucket.views)):
            assert torch.equal(v, w), f"{label}: gradient {i}"


# -- bare modules on 2 and 4 processes ----------------------------------------------------------------
BUCKETS = {"mixed buckets": 0.0001, "single-tensor buckets only": 1e-6, "one flat bucket": None}


def _bare_runs(strategy: pp.Strategy) -> dict:
    coord, world = strategy.session().coords["data"], strategy.topology.size("data")
    out = {}
    for label, mb in BUCKETS.items():
        # one runtime, several policies: each call takes its GradPolicy from the strategy it is made with
        s = strategy.replace(grad_policy=pp.GradPolicy(bucket_mb=mb))
        model = Net()
        out[label] = train_distributed(s, model, list(model.backbone.parameters()), coord, world)
        out[f"fresh, {label}"] = train_fresh_distributed(s, coord, world)
        model = UsedNet()
        out[f"mixed paths, {label}"] = train_distributed(s, model, list(model.backbone.parameters()), coord, world)
    return out


def _check_fresh(results: list[dict], world: int, key: str = "runs") -> None:
    reference = train_fresh_reference(world)
    for label in BUCKETS:
        check_against_reference([r[key][f"fresh, {label}"] for r in results], reference,
                                f"{world} ranks, fresh gradients, {MICRO} backward calls per step, {label}")
        model = UsedNet()
        check_against_reference([r[key][f"mixed paths, {label}"] for r in results],
                                train_reference(model, list(model.backbone.parameters()), world),
                                f"{world} ranks, every gradient on some ranks only, {label}")


def _bare_worker(strategy: pp.Strategy) -> dict:
    hooks = nn.modules.module._global_parameter_registration_hooks
    before = len(hooks)
    out = {"runs": _bare_runs(strategy)}
    during = len(hooks)
    # A list with None cannot be shaped: refused on every rank (the peers learn it), no hang.
    grads = [torch.ones(3), None] if strategy.rank == 1 else [torch.ones(3), torch.ones(2)]
    try:
        strategy.sync_grads(grads)
        out["list"] = "completed"
    except (TypeError, pp.PluginError, pp.CollectiveError) as exc:
        out["list"] = f"{type(exc).__name__}: {exc}"
    strategy.plugin_manager.close_sessions()
    out["hooks"] = (before, during, len(hooks))
    return out


def _check_bare(results: list[dict], world: int) -> None:
    for label in BUCKETS:
        model = Net()
        reference = train_reference(model, list(model.backbone.parameters()), world)
        check_against_reference([r["runs"][label] for r in results], reference, f"{world} ranks, {label}")
    _check_fresh(results, world)
    for r in results:
        before, during, after = r["hooks"]
        assert during == before + 1 and after == before, r["hooks"]  # torch's global hook is scoped
    assert results[1]["list"].split(":")[0] in ("TypeError", "PluginError"), results[1]["list"]
    assert "None at position(s) [1]" in results[1]["list"]
    assert "pass the module" in results[1]["list"].lower()
    assert results[0]["list"].startswith("CollectiveError") and "refused" in results[0]["list"], results[0]["list"]
    assert "None at position(s) [1] on rank 1" in results[0]["list"]


@pytest.mark.timeout(300)
def test_bare_module_two_ranks_freeze_unfreeze_and_unused_branch(run):
    strategy = pp.Strategy(data=2, timeout=60)
    _check_bare(run(_bare_worker, strategy, 2, strategy, timeout=240), 2)


# -- 4 processes: bare module over data=4, and tensor parallel data=2 x tensor=2 -------------------------
class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 1)
        self.b1, self.b2 = nn.Linear(6, 8), nn.Linear(8, 1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        y = self.fc2(torch.relu(self.fc1(x)))
        if use_branch:
            y = y + self.b2(torch.relu(self.b1(x)))
        return y


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "b1": ColwiseParallel(), "b2": RowwiseParallel()}


def _four_worker(strategy: pp.Strategy) -> dict:
    out = {"bare": _bare_runs(strategy)}
    tp = pp.Strategy(data=2, tensor=2, timeout=60, grad_policy=pp.GradPolicy(bucket_mb=0.0001))
    model = tp.wrap_model(TPNet(), plan=tp_plan())
    assert hasattr(model.fc1.weight, "to_local")  # really sharded
    out["tp"] = train_distributed(tp, model, list(model.fc1.parameters()), tp.session().coords["data"], 2)
    return out


@pytest.mark.timeout(400)
def test_four_ranks_bare_module_and_tensor_parallel(run):
    strategy = pp.Strategy(data=4, timeout=60)
    results = run(_four_worker, strategy, 4, strategy, timeout=360)
    for label in BUCKETS:
        model = Net()
        reference = train_reference(model, list(model.backbone.parameters()), 4)
        check_against_reference([r["bare"][label] for r in results], reference, f"4 ranks, {label}")
    _check_fresh(results, 4, key="bare")
    model = TPNet()
    reference = train_reference(model, list(model.fc1.parameters()), 2)
    check_against_reference([r["tp"] for r in results], reference, "data=2 x tensor=2")


# -- another layout on one rank: refused before any payload, gradients untouched --------------------------
def _layout_mismatch_worker(strategy: pp.Strategy) -> dict:
    out = {}
    torch.manual_seed(strategy.rank)
    for label, fresh in (("fresh gradients", True), ("gradients in the buffers", False)):
        s = strategy.replace(timeout=30 + fresh)  # a runtime per scenario: a mismatch breaks the one it used
        model = UsedNet()
        if not fresh:  # one agreed sync first: the gradients then live in the buffers (zeroed in place)
            model(torch.randn(4, 6), True).sum().backward()
            s.sync_grads(model)
        if strategy.rank == 1:
            model.head.bias.requires_grad_(False)  # frozen on this rank only: another bucket layout
        model.zero_grad(set_to_none=fresh)
        model(torch.randn(4, 6), True).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        values = {n: None if g is None else g.clone() for n, g in grads.items()}
        try:
            s.sync_grads(model)  # every gradient present: the path that starts all buckets at once
            out[label] = {"error": None}
        except pp.CollectiveError as exc:
            out[label] = {"error": str(exc)}
        # the packing ran while the check travelled, into polyparallel's own buffers only
        out[label]["same objects"] = all(p.grad is grads[n] for n, p in model.named_parameters())
        out[label]["same values"] = all(
            (g is None and values[n] is None) or torch.equal(g, values[n]) for n, g in grads.items())
    return out


@pytest.mark.timeout(180)
def test_another_layout_on_one_rank_is_refused_before_any_payload(run):
    strategy = pp.Strategy(data=2, timeout=30)
    results = run(_layout_mismatch_worker, strategy, 2, strategy, timeout=150)
    for rank, r in enumerate(results):
        for label, got in r.items():
            assert got["error"] is not None and "sync_grads #" in got["error"], (rank, label, got)
            assert "layout" in got["error"], (rank, label, got)
            assert got["same objects"] and got["same values"], (rank, label, got)


# -- a rank that cannot pack its gradients while the check travels: every rank fails, nothing hangs -------
def _unpackable_worker(strategy: pp.Strategy) -> dict:
    model = UsedNet()
    model(torch.randn(4, 6), True).sum().backward()
    if strategy.rank == 1:
        model.head.weight.grad.data = torch.zeros(2, 4)  # not the parameter's shape: packing it fails
    out: dict = {}
    try:
        strategy.sync_grads(model)  # every gradient present: the path that packs while the check travels
        out["sync"] = None
    except Exception as exc:
        out["sync"] = f"{type(exc).__name__}: {exc}"
    try:  # the check's all-reduce must not pair with a later collective: the runtime refuses them
        strategy.reduce_metrics({"loss": 1.0})
        out["next"] = None
    except Exception as exc:
        out["next"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.timeout(180)
def test_a_rank_that_cannot_pack_its_gradients_fails_every_rank(run):
    strategy = pp.Strategy(data=2, timeout=20)
    bad, good = run(_unpackable_worker, strategy, 2, strategy, timeout=150)[::-1]
    assert bad["sync"] is not None and bad["sync"].startswith("CollectiveError"), bad
    assert "could not pack" in bad["sync"] and "size of tensor" in bad["sync"], bad  # the packing's own error
    assert good["sync"] is not None and good["sync"].startswith("CollectiveTimeout"), good
    assert "sync_grads" in good["sync"] and "rank 1" in good["sync"], good
    for r in (bad, good):
        assert r["next"] is not None and r["next"].startswith("CollectiveError") and "broken" in r["next"], r
