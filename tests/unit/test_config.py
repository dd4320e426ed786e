import re
from pathlib import Path

import pytest

import config
from config import ConfigError, config_path, load_config, mismatched_keys, to_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIG_ARG = re.compile(r"""(?<![\w.])config=["']?([^\s"'`\\]+)""")
# exp/gpu_*_node.sh accept SIZE=1.5b|7b|14b and pass config=gpu_r1_$SIZE; the docs write it as <size>
SIZE_PLACEHOLDER = re.compile(r"\$\{?SIZE\}?|<size>")
SIZES = ("1.5b", "7b", "14b")


def test_default_is_cpu_demo_and_overrides_apply():
    cfg = load_config([])
    assert cfg.config_name == "cpu_demo" and cfg.model.path == "exp/tiny-model"
    cfg = load_config(["train.lr=3e-5", "max_staleness=0", "plan=p.json", "resume=auto", "rollout.top_k=5"])
    assert cfg.train.lr == 3e-5 and cfg.staleness.max_staleness == 0
    assert cfg.plan.path == "p.json" and cfg.checkpoint.resume == "auto" and cfg.rollout.top_k == 5


@pytest.mark.parametrize(
    "arg,needle",
    [
        ("train.lrr=1", "did you mean 'train.lr'"),
        ("max_stalenes=1", "did you mean 'staleness.max_staleness'"),
        ("rollout.temprature=1", "did you mean 'rollout.temperature'"),
    ],
)
def test_unknown_key_names_the_closest(arg, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([arg])


@pytest.mark.parametrize(
    "arg,needle",
    [
        ("train.total_steps=abc", "train.total_steps' expects int"),
        ("train.recompute_prox_logprobs=7", "expects bool"),
        ("staleness.max_staleness=-1", "max_staleness must be >= 0"),
        ("rollout.compile_decode=sometimes", "rollout.compile_decode must be auto\\|always\\|never"),
        ("rollout.flash_attn=maybe", "rollout.flash_attn must be auto\\|always\\|never"),
        ("rollout.prefill_ride_tokens=-1", "rollout.prefill_ride_tokens must be >= 0"),
        ("train.behav_correction=clip", "train.behav_correction must be mask\\|tis"),
        ("train.behav_correction=tis", "truncates at train.behav_imp_weight_cap"),  # with a cap of 0 below
        ("train.behav_correction_bounds=[1.5,2.0]", "behav_correction_bounds must be \\[low, high\\]"),
        ("train.loss_aggregation=seq-sum", "train.loss_aggregation must be token-mean"),
        ("lr", "not of the form key=value"),
        ("config=nope", "config 'nope' not found"),
    ],
)
def test_bad_values_are_one_clear_error(arg, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config([arg, "train.behav_imp_weight_cap=0"] if "tis" in arg else [arg])


def test_every_shipped_config_loads():
    from config import CONFIG_DIR

    for path in CONFIG_DIR.glob("*.yaml"):
        load_config([f"config={path.stem}"])


def test_documented_config_names_exist():
    """Every `config=<name>` in the README, docs/*.md, exp/*.md, exp/*.sh and config.py's docstring resolves as in load_config."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "exp").glob("*.md"))]
    docs += sorted((ROOT / "exp").glob("*.sh"))
    texts = {"config.py docstring": config.__doc__, **{str(p.relative_to(ROOT)): p.read_text() for p in docs}}
    seen, missing = [], []
    for where, text in texts.items():
        for name in CONFIG_ARG.findall(text):
            expansions = [SIZE_PLACEHOLDER.sub(s, name) for s in SIZES] if SIZE_PLACEHOLDER.search(name) else [name]
            for expanded in expansions:
                seen.append(expanded)
                try:
                    config_path(expanded)
                except ConfigError as e:
                    missing.append(f"{where}: config={name}: {e}")
    assert len(seen) >= 5, seen  # the pattern still finds the README's and the scripts' uses
    assert not missing, "\n".join(missing)


def test_mismatched_keys_ignores_resumable_ones():
    a = to_dict(load_config([]))
    b = to_dict(load_config(["train.total_steps=7", "train.lr=1e-3"]))
    assert mismatched_keys(a, b) == ["train.lr"]


def test_moved_keys_still_work_for_one_release_with_one_line(capsys):
    cfg = load_config(["plan.timeout_s=30", "plan.verify_weights=false"])
    assert cfg.dist.timeout_s == 30.0 and cfg.dist.verify_weights is False
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "hexrl: config key 'plan.timeout_s' is deprecated, use 'dist.timeout_s'",
        "hexrl: config key 'plan.verify_weights' is deprecated, use 'dist.verify_weights'",
    ]


def test_a_checkpoint_from_before_the_move_still_resumes():
    current = to_dict(load_config([]))
    saved = to_dict(load_config([]))
    dist = saved.pop("dist")  # the layout checkpoints had before the dist section: these four keys under plan.*
    saved["plan"].update({k: dist[k] for k in ("timeout_s", "rollout_timeout_s", "weight_bucket_mb", "verify_weights")})
    assert mismatched_keys(saved, current) == []


def test_a_key_added_after_the_checkpoint_counts_as_its_default_there():
    saved = to_dict(load_config([]))
    del saved["train"]["min_microbatches"]  # a checkpoint written before the key existed
    assert mismatched_keys(saved, to_dict(load_config([]))) == []
    assert mismatched_keys(saved, to_dict(load_config(["train.min_microbatches=2"]))) == ["train.min_microbatches"]


def test_off_is_zero_and_negative_values_are_refused():
    cfg = load_config(["train.grad_clip=0", "train.behav_imp_weight_cap=0", "train.min_microbatches=0"])
    assert (cfg.train.grad_clip, cfg.train.behav_imp_weight_cap, cfg.train.min_microbatches) == (0, 0, 0)
    for key in ("train.grad_clip", "train.behav_imp_weight_cap", "train.min_microbatches"):
        with pytest.raises(ConfigError, match=f"{key} must be >= 0"):
            load_config([f"{key}=-1"])


def test_colocated_memory_fractions_must_fit_one_device():
    cfg = load_config(["dist.colocate=true", "dist.train_memory_fraction=0.4", "dist.rollout_memory_fraction=0.5"])
    assert cfg.dist.colocate and cfg.dist.train_memory_fraction == 0.4
    with pytest.raises(ConfigError, match="must be <= 1: the roles share one device"):
        load_config(["dist.train_memory_fraction=0.6", "dist.rollout_memory_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\]"):
        load_config(["dist.rollout_memory_fraction=-0.1"])
