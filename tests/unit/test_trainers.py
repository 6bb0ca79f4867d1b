"""Trainer building blocks: registries, data order, LR schedule, models, the flat-buffer local step."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from distrain.errors import ConfigError
from distrain.name_registry import Registry
from distrain.strategies import STRATEGIES
from distrain.trainers.datasets import DATASETS, DatasetInfo, load_dataset
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.models import MODELS, build_model
from distrain.trainers.schedule import LRSchedule, scaled_lr
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.task import ClassificationTask

DIGITS_INFO = DatasetInfo("digits", 1, 8, 8, 10)
CIFAR_SHAPE_INFO = DatasetInfo("cifar-shaped", 3, 32, 32, 10)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small models on a shared 2-core machine: one intra-op thread avoids oversubscription stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- registries
def test_registry_refuses_duplicates_and_answers_unknown_names_with_the_list():
    reg: Registry[int] = Registry("widget")
    reg.register("zeta", "last")(1)
    reg.register("alpha", "first")(2)
    with pytest.raises(ValueError, match="widget 'zeta' is already registered"):
        reg.register("zeta", "again")(3)
    assert reg.get("zeta") == 1  # the refused duplicate did not replace the original
    assert reg.names() == ["alpha", "zeta"]
    assert list(reg) == ["alpha", "zeta"]
    assert reg.describe() == {"alpha": "first", "zeta": "last"}
    assert "alpha" in reg and "beta" not in reg
    with pytest.raises(ConfigError, match=r"unknown widget 'beta'; choose one of: alpha, zeta"):
        reg.get("beta")
    with pytest.raises(ConfigError, match="unknown widget"):
        reg.check("beta")
    reg.check("alpha")


def test_builtin_registries():
    assert MODELS.names() == ["cnn", "linear", "mlp", "resnet18"]
    assert DATASETS.names() == ["cifar10", "digits", "mnist", "synthetic"]
    assert "bsp" in STRATEGIES
    for reg in (MODELS, DATASETS, STRATEGIES):
        assert all(text.strip() for text in reg.describe().values())


@pytest.mark.parametrize("reg", [MODELS, DATASETS, STRATEGIES], ids=["models", "datasets", "strategies"])
def test_builtin_registries_refuse_duplicates(reg):
    name = reg.names()[0]
    original = reg.get(name)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(name, "impostor")(object())
    assert reg.get(name) is original
    with pytest.raises(ConfigError, match=f"choose one of: {', '.join(reg.names())}$"):
        reg.get("no-such-name")


# ---------------------------------------------------------------- EpochSharder
def test_sharder_global_batches_of_an_epoch_are_disjoint():
    s = EpochSharder(num_samples=103, global_batch=20, seed=5)
    assert s.steps_per_epoch == 5  # the incomplete last batch (3 samples) is dropped
    for epoch in range(3):
        batches = [s.global_batch_indices(epoch, k) for k in range(s.steps_per_epoch)]
        assert all(len(b) == 20 for b in batches)
        seen = np.concatenate(batches)
        assert len(np.unique(seen)) == len(seen) == 100
        assert seen.min() >= 0 and seen.max() < 103


def test_sharder_worker_slices_partition_the_global_batch():
    s = EpochSharder(num_samples=200, global_batch=24, seed=1)
    for world in (1, 2, 3, 4, 6):
        for step in (0, 3, s.steps_per_epoch - 1):
            parts = [s.worker_indices(2, step, r, world) for r in range(world)]
            assert all(len(p) == 24 // world for p in parts)
            joined = np.concatenate(parts)
            np.testing.assert_array_equal(joined, s.global_batch_indices(2, step))
            assert len(np.unique(joined)) == 24  # the slices are disjoint


def test_sharder_order_is_determined_by_seed_and_epoch():
    a = EpochSharder(500, 50, seed=3)
    b = EpochSharder(500, 50, seed=3)
    np.testing.assert_array_equal(a.order(0), b.order(0))
    np.testing.assert_array_equal(a.global_batch_indices(4, 7), b.global_batch_indices(4, 7))
    assert not np.array_equal(a.order(0), a.order(1))  # a new epoch reshuffles
    assert not np.array_equal(a.order(0), EpochSharder(500, 50, seed=4).order(0))  # so does a new seed
    assert sorted(a.order(1).tolist()) == list(range(500))  # each order is a permutation
    # cached orders of one sharder do not leak into another with a different seed
    np.testing.assert_array_equal(a.order(0), np.random.default_rng([3, 0]).permutation(500))


def test_one_worker_at_2b_sees_what_two_workers_at_b_see():
    n, b, seed = 301, 16, 9
    one = EpochSharder(n, 1 * (2 * b), seed)  # 1 worker, batch 2B
    two = EpochSharder(n, 2 * b, seed)  # 2 workers, batch B
    assert one.steps_per_epoch == two.steps_per_epoch
    for epoch in (0, 1):
        for step in range(one.steps_per_epoch):
            big = one.worker_indices(epoch, step, 0, 1)
            small = [two.worker_indices(epoch, step, r, 2) for r in range(2)]
            assert all(len(p) == b for p in small)
            np.testing.assert_array_equal(big, np.concatenate(small))


def test_sharder_rejects_impossible_requests():
    with pytest.raises(ConfigError, match="global batch 101 exceeds the 100 training samples"):
        EpochSharder(100, 101, 0)
    s = EpochSharder(100, 30, 0)
    with pytest.raises(ValueError, match="does not split into 4"):
        s.worker_indices(0, 0, 0, 4)
    with pytest.raises(IndexError):
        s.global_batch_indices(0, s.steps_per_epoch)
    with pytest.raises(IndexError):
        s.global_batch_indices(0, -1)


# ---------------------------------------------------------------- LR scaling and warmup
def test_lr_scaling_rules():
    assert scaled_lr(0.1, 256, 64, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.1, 256, 64, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 256, 64, "none") == pytest.approx(0.1)
    assert scaled_lr(0.1, 32, 64, "linear") == pytest.approx(0.05)
    assert scaled_lr(0.1, 32, 64, "sqrt") == pytest.approx(0.1 / math.sqrt(2))
    assert scaled_lr(0.1, 64, 64, "linear") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown lr scaling rule"):
        scaled_lr(0.1, 64, 64, "cubic")


def test_warmup_rises_linearly_from_base_to_peak_then_stays():
    sched = LRSchedule.create(0.1, 256, 64, "linear", warmup_epochs=2, steps_per_epoch=5)
    assert (sched.base_lr, sched.warmup_steps) == (0.1, 10)
    assert sched.peak_lr == pytest.approx(0.4)
    expected = {0: 0.1, 1: 0.13, 5: 0.25, 9: 0.37, 10: 0.4, 11: 0.4, 10_000: 0.4}
    for step, lr in expected.items():
        assert sched.lr_at(step) == pytest.approx(lr), step
    rates = [sched.lr_at(k) for k in range(30)]
    assert all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    steps = np.diff(rates[:11])
    np.testing.assert_allclose(steps, 0.03)  # equal increments: linear


def test_no_warmup_means_constant_peak():
    sched = LRSchedule.create(0.05, 128, 64, "sqrt", warmup_epochs=0, steps_per_epoch=10)
    assert sched.warmup_steps == 0
    for step in (0, 1, 50):
        assert sched.lr_at(step) == pytest.approx(0.05 * math.sqrt(2))


def test_fractional_warmup_epochs():
    sched = LRSchedule.create(0.1, 64, 64, "none", warmup_epochs=0.5, steps_per_epoch=8)
    assert sched.warmup_steps == 4
    assert [sched.lr_at(k) for k in range(6)] == pytest.approx([0.1] * 6)  # base == peak: flat


# ---------------------------------------------------------------- models
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18"])
@pytest.mark.parametrize("info", [DIGITS_INFO, CIFAR_SHAPE_INFO], ids=["1x8x8", "3x32x32"])
def test_models_build_for_both_shapes(name, info):
    model = build_model(name, info, seed=0).eval()
    x = torch.randn(3, info.channels, info.height, info.width)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (3, info.num_classes)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18"])
def test_same_seed_same_weights(name):
    a = build_model(name, DIGITS_INFO, seed=11).state_dict()
    b = build_model(name, DIGITS_INFO, seed=11).state_dict()
    c = build_model(name, DIGITS_INFO, seed=12).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model("mlp", DIGITS_INFO, seed=0)
    assert torch.equal(torch.rand(4), expected)


# ---------------------------------------------------------------- LocalTrainer
def make_trainer(data, name="mlp", optimizer="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, seed=0):
    task = ClassificationTask(name, "digits")
    return LocalTrainer(build_model(name, data.info, seed), task, optimizer, lr, momentum, weight_decay)


def evaluate(trainer, data, batch_size=512, shard=0, num_shards=1):
    """(loss sum, correct, count) of the trainer's model on a share of the digits test set."""
    sums = trainer.evaluate(data.test_batches(batch_size, shard, num_shards))
    assert sums["loss"][1] == sums["accuracy"][1]
    return sums["loss"][0], sums["accuracy"][0], sums["loss"][1]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_gradients_are_views_of_the_flat_buffer(digits, name):
    trainer = make_trainer(digits, name, momentum=0.9)
    x, y = digits.train_batch(np.arange(32))
    flat_storage = trainer.grads_flat.untyped_storage().data_ptr()
    for _ in range(2):  # and they stay attached after an optimizer step
        loss = trainer.compute_gradients((x, y))
        assert math.isfinite(loss)
        assert trainer._grads_are_views is True
        for p in trainer.params:
            assert p.grad.untyped_storage().data_ptr() == flat_storage
            assert p.untyped_storage().data_ptr() == trainer.params_flat.untyped_storage().data_ptr()
        joined = torch.cat([p.grad.reshape(-1) for p in trainer.params])
        assert torch.equal(joined, trainer.grads_flat)
        assert trainer.grads_flat.abs().sum() > 0
        trainer.apply_update(0.05)
    assert trainer.nbytes == trainer.numel * 4


def test_flat_gradient_equals_a_plain_backward_pass(digits):
    trainer = make_trainer(digits, "cnn", seed=3)
    reference = build_model("cnn", digits.info, 3)
    x, y = digits.train_batch(np.arange(40, 72))
    trainer.compute_gradients((x, y))
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(trainer.grads_flat, expected)


def test_a_second_step_does_not_accumulate_gradients(digits):
    trainer = make_trainer(digits)
    x, y = digits.train_batch(np.arange(16))
    trainer.compute_gradients((x, y))
    first = trainer.grads_flat.clone()
    trainer.compute_gradients((x, y))  # same batch, no update in between: same gradient, not twice it
    torch.testing.assert_close(trainer.grads_flat, first)


def test_apply_update_is_an_sgd_step_on_params_flat(digits):
    trainer = make_trainer(digits, lr=0.1)
    x, y = digits.train_batch(np.arange(64))
    trainer.compute_gradients((x, y))
    before = trainer.params_flat.clone()
    grads = trainer.grads_flat.clone()
    trainer.apply_update(0.25)  # the rate passed in wins over the one the optimizer was built with
    assert not torch.equal(trainer.params_flat, before)
    torch.testing.assert_close(trainer.params_flat, before - 0.25 * grads)
    # the model's parameters are the flat buffer: the model sees the update
    torch.testing.assert_close(
        torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]), trainer.params_flat
    )


def test_plain_sgd_learns_digits(digits):
    torch.manual_seed(0)
    trainer = make_trainer(digits, "mlp", lr=0.1, momentum=0.0)
    before_loss, before_correct, before_count = evaluate(trainer, digits)
    sharder = EpochSharder(digits.train_size, 64, seed=0)
    step = 0
    for epoch in range(20):
        for k in range(sharder.steps_per_epoch):
            x, y = digits.train_batch(sharder.global_batch_indices(epoch, k))
            trainer.compute_gradients((x, y))
            trainer.apply_update(0.1)
            step += 1
        if step >= 300:
            break
    loss_sum, correct, count = evaluate(trainer, digits)
    assert count == digits.test_size == 359
    assert before_correct / before_count < 0.5
    assert correct / count >= 0.9, (correct, count)
    assert loss_sum / count < before_loss / before_count


def test_sharded_evaluation_adds_up(digits):
    trainer = make_trainer(digits, "mlp")
    whole = evaluate(trainer, digits, batch_size=100)
    parts = [evaluate(trainer, digits, batch_size=50, shard=r, num_shards=3) for r in range(3)]
    assert sum(p[2] for p in parts) == whole[2] == digits.test_size
    assert sum(p[1] for p in parts) == whole[1]
    assert sum(p[0] for p in parts) == pytest.approx(whole[0], rel=1e-5)


def test_state_dict_round_trip_keeps_views(digits):
    a = make_trainer(digits, "mlp", seed=1, momentum=0.9)
    b = make_trainer(digits, "mlp", seed=2, momentum=0.9)
    x, y = digits.train_batch(np.arange(32))
    a.compute_gradients((x, y))
    a.apply_update(0.1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.params_flat, b.params_flat)
    b.compute_gradients((x, y))
    assert b._grads_are_views is True


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_state_dict_pickles_to_the_size_of_its_tensors(digits, optimizer):
    """The state crosses Ray by pickle: views of params_flat pickled the whole buffer once per parameter
    tensor (issue 13: a cnn's final.pt was 9x its parameters and momentum). Now it is what it holds."""
    import pickle

    trainer = make_trainer(digits, "cnn", optimizer, 0.05, 0.9 if optimizer == "sgd" else None)
    x, y = digits.train_batch(np.arange(32))
    trainer.compute_gradients((x, y))
    trainer.apply_update(0.05)
    state = trainer.state_dict()
    tensors = [*state["model"].values(), *state["optimizer"]["vectors"].values()]
    payload = sum(t.numel() * t.element_size() for t in tensors)
    assert payload >= trainer.nbytes * (2 if optimizer == "sgd" else 3)  # parameters + one or two vectors
    assert len(pickle.dumps(state)) < payload + 64 * 1024
    before = trainer.params_flat.clone()
    state["model"][next(iter(state["model"]))].add_(1.0)  # a copy: changing it leaves the trainer alone
    assert torch.equal(trainer.params_flat, before)


# ---------------------------------------------------------------- the bundled digits split
def test_digits_load_without_importing_scikit_learn():
    """Every worker loads digits; importing scikit-learn costs each about 1.2 CPU-s (the suite starts
    hundreds): the CSV it ships is read directly. Content: test_digits_split_is_fixed_and_disjoint."""
    probe = (
        "import sys; from distrain.trainers.datasets import load_dataset; "
        "load_dataset('digits'); print('sklearn' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_digits_split_is_fixed_and_disjoint(digits):
    from sklearn.datasets import load_digits

    np.random.seed(99)  # the split must not depend on global RNG state
    torch.manual_seed(99)
    again = load_dataset("digits")
    assert torch.equal(again.test_x, digits.test_x) and torch.equal(again.test_y, digits.test_y)
    assert torch.equal(again.train_x, digits.train_x) and torch.equal(again.train_y, digits.train_y)

    raw = load_digits()
    index_of = {img.astype(np.float32).tobytes(): i for i, img in enumerate(raw.images)}
    assert len(index_of) == len(raw.images)  # no duplicate images, so an image names its index

    def indices(x: torch.Tensor, y: torch.Tensor) -> list[int]:
        idx = [index_of[img[0].numpy().tobytes()] for img in x]
        np.testing.assert_array_equal(raw.target[idx], y.numpy())  # labels travel with their images
        return idx

    train, test = indices(digits.train_x, digits.train_y), indices(digits.test_x, digits.test_y)
    assert len(set(test)) == len(test) == 359  # round(0.2 * 1797)
    assert not set(train) & set(test)
    assert len(train) + len(test) == 1797 and set(train) | set(test) == set(range(1797))
    assert digits.info == DIGITS_INFO
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64


def test_cosine_decay_after_warmup_falls_from_the_peak_to_the_floor():
    # peak 0.4 after 2 epochs x 5 steps of warmup, then 20 steps of half a cosine down to 0.04
    sched = LRSchedule.create(
        0.1, 256, 64, "linear", warmup_epochs=2, steps_per_epoch=5, decay="cosine", total_steps=30, min_lr=0.04
    )
    assert sched.lr_at(5) == pytest.approx(0.25)  # warmup unchanged
    assert sched.lr_at(10) == pytest.approx(0.4)  # the peak, where decay starts
    for t in (1, 5, 10, 19):
        assert sched.lr_at(10 + t) == pytest.approx(0.04 + 0.36 * (1 + math.cos(math.pi * t / 20)) / 2)
    assert sched.lr_at(20) == pytest.approx(0.22)  # halfway: the mean of peak and floor
    assert sched.lr_at(30) == pytest.approx(0.04) and sched.lr_at(99) == pytest.approx(0.04)
    after = [sched.lr_at(k) for k in range(10, 30)]
    assert all(b < a for a, b in zip(after, after[1:], strict=False)) and after[-1] > 0.04


def test_cosine_without_warmup_starts_at_the_peak_and_defaults_to_zero():
    sched = LRSchedule.create(0.1, 64, 64, "none", warmup_epochs=0, steps_per_epoch=4, decay="cosine", total_steps=8)
    assert sched.lr_at(0) == pytest.approx(0.1)
    assert sched.lr_at(4) == pytest.approx(0.05)
    assert sched.lr_at(8) == pytest.approx(0.0)


def test_step_decay_multiplies_by_gamma_every_few_epochs_after_warmup():
    sched = LRSchedule.create(
        0.1, 128, 64, "linear", warmup_epochs=1, steps_per_epoch=4, decay="step", decay_epochs=1.5, gamma=0.5
    )
    assert (sched.warmup_steps, sched.decay_every) == (4, 6)
    rates = [sched.lr_at(k) for k in range(4, 22)]
    assert rates == pytest.approx([0.2] * 6 + [0.1] * 6 + [0.05] * 6)
    assert sched.lr_at(0) == pytest.approx(0.1) and sched.lr_at(2) == pytest.approx(0.15)


def test_no_decay_is_the_constant_schedule_it_was():
    a = LRSchedule.create(0.1, 256, 64, "linear", warmup_epochs=1, steps_per_epoch=5)
    b = LRSchedule.create(0.1, 256, 64, "linear", warmup_epochs=1, steps_per_epoch=5, decay="none", total_steps=9)
    assert [a.lr_at(k) for k in range(20)] == [b.lr_at(k) for k in range(20)]
    assert a.lr_at(19) == pytest.approx(0.4)


def test_training_mode_is_set_once_and_again_after_an_evaluation():
    """compute_gradients puts the model in training mode without walking its modules every step."""
    data = load_dataset("digits")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(64, 10))
    model.eval()  # as built by a task that left it in eval mode: the first step still trains
    trainer = LocalTrainer(model, ClassificationTask(), "sgd", 0.1, 0.0, 0.0)
    walks = []
    original = type(model).train

    def counted(self, mode=True):
        walks.append(mode)
        return original(self, mode)

    model.train = counted.__get__(model)
    batch = data.train_batch(np.arange(16))
    for _ in range(3):
        trainer.compute_gradients(batch)
        assert all(m.training for m in model.modules())
    assert walks == [True]
    trainer.evaluate([batch])  # leaves the model in eval mode
    assert not model[1].training
    trainer.compute_gradients(batch)
    assert all(m.training for m in model.modules()) and walks == [True, False, True]  # eval() is train(False)
