"""The prefill benchmark's variant selection (no GPU)."""
import pytest

from profiles.bench_prefill import CUTE_VARIANTS, select_cute_variants


def test_all_variants_by_default():
    assert select_cute_variants(None) == list(CUTE_VARIANTS)


def test_joined_variants_merge_their_overrides_on_shared_head_dims():
    # 3_stages is a d128-only entry; pingpong flips the default at each head dim; hoisted_desc covers both
    chosen = dict(select_cute_variants(["default", "pingpong+hoisted_desc", "3_stages+hoisted_desc"]))
    assert chosen["default"] == {128: {}, 256: {}}
    assert chosen["pingpong+hoisted_desc"] == {128: {"pingpong": True, "hoisted_qk_desc": True},
                                               256: {"pingpong": False, "hoisted_qk_desc": True}}
    assert chosen["3_stages+hoisted_desc"] == {128: {"kv_stages": 3, "hoisted_qk_desc": True}}
    # the later entry's field wins
    assert dict(select_cute_variants(["hoisted_desc+dsl_desc"]))["hoisted_desc+dsl_desc"][128] == {
        "hoisted_qk_desc": False}


@pytest.mark.parametrize("labels", [["nope"], ["default+nope"], ["pingpong+"]])
def test_unknown_variant_is_named(labels):
    with pytest.raises(ValueError, match="unknown"):
        select_cute_variants(labels)
