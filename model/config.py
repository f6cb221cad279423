"""Qwen3.5 configuration: one dataclass, read from an HF config.json (flat or VLM-nested) or a preset."""
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from reference.checks import check_real, is_int, is_real

LAYER_TYPES = ("linear_attention", "full_attention")
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "conv": "linear_attention", "mamba": "linear_attention"}
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # what from_hf reads
_MAY_BE_ZERO = ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "mtp_num_hidden_layers")  # 0 where the MLP is MoE, or dense; no MTP


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int = 248320
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    intermediate_size: int = 12288
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    num_experts: int = 0  # 0: dense SwiGLU MLP; > 0: sparse MoE in every layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int = 262144
    mtp_num_hidden_layers: int = 0  # the multi-token-prediction head's decoder layers (`mtp.*`; released: 1)
    eos_token_ids: tuple[int, ...] = field(default=(248044, 248046))

    def __post_init__(self):
        self._check_numbers()
        if not self.layer_types:
            types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer_types entries {sorted(set(map(str, bad)))}; expected one of "
                             f"{LAYER_TYPES}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}]")
        if (self.moe_intermediate_size if self.num_experts else self.intermediate_size) < 1:
            raise ValueError("the MLP needs intermediate_size >= 1 (dense) or moe_intermediate_size >= 1 (MoE)")
        if self.rotary_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor must be an even rotary width, got {self.rotary_dim}")

    def _check_numbers(self) -> None:
        """Sizes are ints (not bools): positive, or >= 0 for the MLP's either-or sizes; eps >= 0, rope_theta > 0
        and partial_rotary_factor in (0, 1] are finite numbers; eos ids are ints."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and (not is_int(value) or value < (0 if f.name in _MAY_BE_ZERO else 1)):
                raise ValueError(f"{f.name} must be a {'non-negative' if f.name in _MAY_BE_ZERO else 'positive'} "
                                 f"int, got {value!r}"[:200])
        check_real("rms_norm_eps", self.rms_norm_eps)
        check_real("rope_theta", self.rope_theta, positive=True)
        check_real("partial_rotary_factor", self.partial_rotary_factor, positive=True, high=1.0)
        if not all(is_int(t) for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be ints, got {self.eos_token_ids!r}"[:200])

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short convolution: q | k | v."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen35Config":
        """Build from an HF config dict: flat `qwen3_5_text`/`qwen3_5_moe_text`, or nested under `text_config`.
        A config of another model_type (or with a quantization_config) is refused."""
        if not isinstance(hf, dict) or not isinstance(hf.get("text_config") or {}, dict):
            raise ValueError("the HF config must be a JSON object (and its text_config one, when given)")
        if "quantization_config" in hf:
            raise ValueError("quantized checkpoints are not supported (the config has a quantization_config)")
        text = dict(hf.get("text_config") or hf)
        for d in (hf, text):
            if d.get("model_type", MODEL_TYPES[0]) not in MODEL_TYPES:
                raise ValueError(f"model_type {d['model_type']!r} is not a Qwen3.5 one {MODEL_TYPES}")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):  # M-RoPE is plain 1-D rope for text
            raise ValueError(f"unsupported rope_type {rope_type!r}: only default rope (or M-RoPE) is implemented")
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        n_layers = text.get("num_hidden_layers", cls.num_hidden_layers)
        types = text.get("layer_types")
        if types is None:
            interval = text.get("full_attention_interval", 4)
            if not is_int(interval) or interval < 1:
                raise ValueError(f"full_attention_interval must be a positive int, got {interval!r}")
            if not isinstance(n_layers, int):
                raise ValueError(f"num_hidden_layers must be a positive int, got {n_layers!r}")
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if not isinstance(types, list | tuple):
            raise ValueError(f"layer_types must be a list, got {types!r}"[:200])
        types = tuple(_LEGACY_LAYER_TYPES.get(t, t) if isinstance(t, str) else t for t in types)
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else cls.eos_token_ids)
        if not all(is_int(t) for t in eos):
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}"[:200])
        kw = {f: text[f] for f in _HF_FIELDS if f in text}
        # transformers ties a VLM's lm_head by the top-level flag, whatever its text_config says
        tie = hf["tie_word_embeddings"] if hf.get("text_config") and "tie_word_embeddings" in hf \
            else text.get("tie_word_embeddings", False)
        for name, value in (("rope_theta", theta), ("partial_rotary_factor", partial)):
            if not is_real(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}"[:200])
        return cls(**kw, rope_theta=float(theta), partial_rotary_factor=float(partial), layer_types=types,
                   tie_word_embeddings=bool(tie), eos_token_ids=tuple(sorted(set(eos) | set(cls.eos_token_ids))))

    @classmethod
    def from_json(cls, path) -> "Qwen35Config":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self, moe_model_type: bool | None = None) -> dict:
        """A flat HF text config dict (what transformers' Qwen3_5[Moe]TextConfig takes)."""
        d = {f: getattr(self, f) for f in _HF_FIELDS if f in _DENSE_FIELDS or self.is_moe}
        d.update(layer_types=list(self.layer_types), tie_word_embeddings=self.tie_word_embeddings,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor})
        d["model_type"] = "qwen3_5_moe_text" if self.is_moe else "qwen3_5_text"
        return d


_DENSE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
                 "max_position_embeddings", "mtp_num_hidden_layers")
_HF_FIELDS = _DENSE_FIELDS + ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                              "shared_expert_intermediate_size")

# The released Qwen3.5 checkpoints' sizes (the fields left out are the defaults they share: vocab 248320, head_dim
# 256, 16 linear key heads, dk = dv = 128); the weights of a preset are seeded random, for speed and tests only.
PRESETS: dict[str, Qwen35Config] = {
    "qwen3.5-0.8b": Qwen35Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                                 linear_num_value_heads=16, intermediate_size=3584, tie_word_embeddings=True,
                                 mtp_num_hidden_layers=1),
    "qwen3.5-2b": Qwen35Config(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                               linear_num_value_heads=16, intermediate_size=6144, tie_word_embeddings=True,
                               mtp_num_hidden_layers=1),
    "qwen3.5-4b": Qwen35Config(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                               linear_num_value_heads=32, intermediate_size=9216, tie_word_embeddings=True,
                               mtp_num_hidden_layers=1),
    "qwen3.5-9b": Qwen35Config(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                               linear_num_value_heads=32, intermediate_size=12288, mtp_num_hidden_layers=1),
    "qwen3.5-27b": Qwen35Config(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                                linear_num_value_heads=48, intermediate_size=17408, mtp_num_hidden_layers=1),
    "qwen3.5-35b-a3b": Qwen35Config(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                    num_key_value_heads=2, linear_num_value_heads=32, intermediate_size=0,
                                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                    shared_expert_intermediate_size=512, mtp_num_hidden_layers=1),
    # Small presets that run fast on the CPU, with the real vocabulary so the real tokenizer works.
    "tiny": Qwen35Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
                         mtp_num_hidden_layers=1),
    "tiny-moe": Qwen35Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, intermediate_size=0, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=32, linear_value_head_dim=32, tie_word_embeddings=True,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, mtp_num_hidden_layers=1),
}


def get_preset(name: str, **overrides) -> Qwen35Config:
    """A preset by name, e.g. 'qwen3.5-9b' or 'tiny', with optional field overrides."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return replace(PRESETS[key], **overrides)
