"""The MoE weight names we push (the HF checkpoint's, `hf_state_dict_keys`) against SGLang 0.5.23's Qwen MoE loaders,
read from the installed source. SGLang's load_weights skips a name it cannot map without a word, so a drift would
leave stale weights: every per-expert name must be taken by SGLang's own expert mapping (its
`FusedMoE.make_expert_params_mapping`, executed from its source, called as its qwen3_moe / qwen2_moe loaders call it)
with the right expert and shard and skipped by the stacked (q/k/v, gate/up) mapping; the router and the shared expert
load directly, into modules those classes define."""

from __future__ import annotations

import ast

import pytest
from transformers import AutoConfig

from megatron_dapo.actor.arch import num_experts
from megatron_dapo.actor.hf_weights import hf_state_dict_keys
from tests.actor._tiny_models import every_tiny_checkpoint
from tests.rollout.test_sglang_adapter import ROOT
from tests.rollout.test_sglang_adapter import _classes
from tests.rollout.test_sglang_adapter import _parse
from tests.rollout.test_sglang_adapter import needs_sglang

MODELS = {"qwen3_moe": "srt/models/qwen3_moe.py", "qwen2_moe": "srt/models/qwen2_moe.py"}


def _function(path, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(_parse(path)) if isinstance(n, ast.FunctionDef) and n.name == name)


def _expert_mapping(num_experts: int, call: ast.Call) -> list[tuple[str, str, int, str]]:
    """SGLang's FusedMoE.make_expert_params_mapping run from its source with the loader's keyword arguments."""
    fn = _function(ROOT / "srt/layers/moe/fused_moe_triton/layer.py", "make_expert_params_mapping")
    fn = ast.FunctionDef(**{**{f: getattr(fn, f) for f in fn._fields}, "decorator_list": []})
    scope: dict = {"List": list, "Tuple": tuple}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), "layer.py", "exec"), scope)
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "num_experts"}
    return scope["make_expert_params_mapping"](None, num_experts=num_experts, **kwargs)


def _loader(path) -> tuple[list[tuple], ast.Call]:
    """(stacked_params_mapping, the make_expert_params_mapping call) of the model's load_weights."""
    fn = _function(path, "load_weights")
    stacked = next(
        ast.literal_eval(n.value)
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "stacked_params_mapping"
    )
    call = next(
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("make_expert_params_mapping",)
    )
    return stacked, call


def _assigned(cls: ast.ClassDef) -> set[str]:
    return {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


@needs_sglang
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_moe_name_we_push_is_taken_by_sglangs_loader(name):
    path = ROOT / MODELS[name]
    hf_config = AutoConfig.from_pretrained(every_tiny_checkpoint()[name])
    stacked, call = _loader(path)
    fn = _function(path, "load_weights")
    skips_experts = any(isinstance(n, ast.Constant) and n.value == "mlp.experts" for n in ast.walk(fn))
    mapping = _expert_mapping(hf_config.num_experts, call)
    names = hf_state_dict_keys(hf_config)
    taken = {}
    for key in names:
        if "mlp.experts" in key:
            # gate_proj / up_proj match the stacked (gate_up_proj) mapping too: SGLang's loader must skip expert
            # names there before renaming them (its `if "mlp.experts" in name: continue`).
            assert skips_experts and any(w in key for _, w, _ in stacked) == ("down_proj" not in key), key
            hits = [(p, e, s) for p, w, e, s in mapping if w in key]
            assert len(hits) == 1, (key, hits)
            taken[key] = hits[0]
        else:
            assert not any(w in key for _, w, _, _ in mapping), key  # e.g. shared_expert.* is not an expert
    want = {"gate_proj": ("experts.w13_", "w1"), "up_proj": ("experts.w13_", "w3"), "down_proj": ("experts.w2_", "w2")}
    for key, (param, expert, shard) in taken.items():
        e, proj = key.split(".")[5:7]  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
        assert (param, shard) == want[proj] and expert == int(e), key
    assert len(taken) == 3 * hf_config.num_experts * hf_config.num_hidden_layers
    # Direct loads: the router (and Qwen2-MoE's shared expert and its gate) are modules of the sparse block.
    classes = _classes([_parse(path)])
    block = classes[{"qwen3_moe": "Qwen3MoeSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock"}[name]]
    direct = {k.split(".")[4] for k in names if ".mlp." in k and "mlp.experts" not in k}
    assert direct <= _assigned(block), direct - _assigned(block)
    assert ("shared_expert" in direct) == (name == "qwen2_moe")


@needs_sglang
def test_every_mixtral_name_we_push_is_taken_by_sglangs_loader():
    """Mixtral (issue 41): SGLang 0.5.23's mixtral.py maps the checkpoint's block_sparse_moe.experts.{e}.{w1,w3,w2}
    names (its make_expert_params_mapping with ckpt names w1 / w2 / w3, executed from its source) and loads the router
    block_sparse_moe.gate directly; its stacked mapping is q/k/v only, which no expert name matches."""
    path = ROOT / "srt/models/mixtral.py"
    hf_config = AutoConfig.from_pretrained(every_tiny_checkpoint()["mixtral"])
    stacked, call = _loader(path)
    mapping = _expert_mapping(hf_config.num_local_experts, call)
    names = hf_state_dict_keys(hf_config)
    taken = {}
    for key in names:
        hits = [(p, e, s) for p, w, e, s in mapping if w in key]
        if ".block_sparse_moe.experts." in key:
            assert not any(w in key for _, w, _ in stacked), key
            assert len(hits) == 1, (key, hits)
            taken[key] = hits[0]
        else:
            assert not hits, key
    want = {"w1": ("experts.w13_", "w1"), "w3": ("experts.w13_", "w3"), "w2": ("experts.w2_", "w2")}
    for key, (param, expert, shard) in taken.items():
        e, proj = key.split(".")[5:7]  # model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w2,w3}.weight
        assert (param, shard) == want[proj] and expert == int(e), key
    assert len(taken) == 3 * hf_config.num_local_experts * hf_config.num_hidden_layers
    block = _classes([_parse(path)])["MixtralMoE"]
    direct = {k.split(".")[4] for k in names if ".block_sparse_moe." in k and ".experts." not in k}
    assert direct == {"gate"} and direct <= _assigned(block)
    decoder = _classes([_parse(path)])["MixtralDecoderLayer"]
    assert "block_sparse_moe" in _assigned(decoder)


@needs_sglang
def test_every_glm4_moe_name_we_push_is_taken_by_sglangs_loader():
    """GLM-4.5 (issue 41): SGLang 0.5.23's glm4_moe.py skips expert names in its stacked mapping (q/k/v, gate/up:
    the shared experts' and the dense layers' MLPs take it), maps mlp.experts.{e}.{gate,up,down}_proj with its
    make_expert_params_mapping (executed from its source), builds a layer sparse from first_k_dense_replace on as the
    actor does, and loads the router's weight and fp32 correction bias directly into its gate's parameters."""
    path = ROOT / "srt/models/glm4_moe.py"
    hf_config = AutoConfig.from_pretrained(every_tiny_checkpoint()["glm4_moe"])
    stacked, call = _loader(path)
    fn = _function(path, "load_weights")
    assert any(isinstance(n, ast.Constant) and n.value == "mlp.experts" for n in ast.walk(fn))
    mapping = _expert_mapping(num_experts(hf_config), call)
    names = hf_state_dict_keys(hf_config)
    taken = {}
    for key in names:
        hits = [(p, e, s) for p, w, e, s in mapping if w in key]
        if ".mlp.experts." in key:
            assert len(hits) == 1, (key, hits)
            taken[key] = hits[0]
        else:
            assert not hits, key
    want = {"gate_proj": ("experts.w13_", "w1"), "up_proj": ("experts.w13_", "w3"), "down_proj": ("experts.w2_", "w2")}
    for key, (param, expert, shard) in taken.items():
        e, proj = key.split(".")[5:7]
        assert (param, shard) == want[proj] and expert == int(e), key
    sparse = hf_config.num_hidden_layers - hf_config.first_k_dense_replace
    assert len(taken) == 3 * num_experts(hf_config) * sparse
    sparse_rule = _function(path, "_is_layer_sparse")
    assert "first_k_dense_replace" in ast.unparse(sparse_rule) and ">=" in ast.unparse(sparse_rule)
    classes = _classes([_parse(path)])
    moe = {k.split(".")[4] for k in names if ".mlp." in k and ".mlp.experts." not in k and ".layers.0." not in k}
    assert moe == {"gate", "shared_experts"} and moe <= _assigned(classes["Glm4MoeSparseMoeBlock"])
    router = {k.split(".")[5] for k in names if ".mlp.gate." in k}
    assert router == {"weight", "e_score_correction_bias"} and router <= _assigned(classes["Glm4MoeGate"])
    dense = {k.split(".")[4] for k in names if ".layers.0.mlp." in k}  # stacked gate/up -> gate_up_proj, and down
    assert dense == {"gate_proj", "up_proj", "down_proj"}
    assert {"gate_up_proj", "down_proj"} <= _assigned(classes["Glm4MoeMLP"])


@needs_sglang
def test_every_deepseek_v3_name_we_push_is_taken_by_sglangs_loader():
    """DeepSeek-V3 (issue 41): SGLang 0.5.23's deepseek_v2.py (DeepseekV3ForCausalLM; its loader in
    deepseek_common/deepseek_weight_loader.py) maps the routed experts with make_expert_params_mapping (executed
    from its source), fuses q_a_proj with kv_a_proj_with_mqa (only when both arrive in one call:
    weight_sync.LOADED_TOGETHER), and loads the other attention projections, norms, the router's weight and
    correction bias and the shared experts into modules its classes define; a layer is sparse from
    first_k_dense_replace on (moe_layer_freq 1), as the actor's."""
    from megatron_dapo.rollout.weight_sync import LOADED_TOGETHER

    path = ROOT / "srt/models/deepseek_v2.py"
    loader = ROOT / "srt/models/deepseek_common/deepseek_weight_loader.py"
    hf_config = AutoConfig.from_pretrained(every_tiny_checkpoint()["deepseek_v3"])
    fn = _function(loader, "do_load_weights")
    call = next(n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
                "make_expert_params_mapping")  # fmt: skip
    mapping = _expert_mapping(num_experts(hf_config), call)
    source = ast.unparse(fn)
    for first, second in LOADED_TOGETHER:  # the pair its loader fuses, by the names it tests
        assert f"'{first.split('.')[1]}' in name" in source and f"'{second.split('.')[1]}' in name" in source
    names = hf_state_dict_keys(hf_config)
    taken = 0
    for key in names:
        hits = [(p, e, s) for p, w, e, s in mapping if w in key]
        assert len(hits) == (1 if ".mlp.experts." in key else 0), (key, hits)
        taken += bool(hits)
    assert taken == 3 * num_experts(hf_config) * (hf_config.num_hidden_layers - hf_config.first_k_dense_replace)
    rule = ast.unparse(_function(path, "_is_layer_sparse"))
    assert "layer_id >= config.first_k_dense_replace" in rule and "config.moe_layer_freq" in rule
    classes = _classes([_parse(path)])
    attn = {k.split(".")[4] for k in names if ".self_attn." in k} - {"q_a_proj", "kv_a_proj_with_mqa"}
    assert attn == {"q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"}
    assert attn | {"fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa"} <= _assigned(classes["DeepseekV2AttentionMLA"])
    moe = {k.split(".")[4] for k in names if ".mlp." in k and ".mlp.experts." not in k and ".layers.0." not in k}
    assert moe == {"gate", "shared_experts"} and moe <= _assigned(classes["DeepseekV2MoE"])
    router = {k.split(".")[5] for k in names if ".mlp.gate." in k}
    assert router == {"weight", "e_score_correction_bias"} and router <= _assigned(classes["MoEGate"])
