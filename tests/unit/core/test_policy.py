"""BatchPolicy and ClassPolicy: validated once, naming the field and what was expected."""

from __future__ import annotations

import math

import pytest

from carpool import BatchPolicy, ClassPolicy, ConfigError
from carpool.core.policy import DEFAULT_CLASS, DEFAULT_CLASSES


def _check(excinfo: pytest.ExceptionInfo[ConfigError], field: str, expected: str) -> None:
    error = excinfo.value
    assert error.field == field
    assert expected in error.expected
    message = str(error)
    assert field in message
    assert expected in message


# -- BatchPolicy fields ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "8", None])
def test_rejects_max_batch_size_that_is_not_a_positive_int(value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_batch_size=value)  # type: ignore[arg-type]
    _check(excinfo, "max_batch_size", "an integer >= 1")
    assert excinfo.value.value is value


@pytest.mark.parametrize("value", [-0.001, math.nan, math.inf, -math.inf, True, "0.1"])
def test_rejects_max_delay_s_that_is_negative_or_not_finite(value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_delay_s=value)  # type: ignore[arg-type]
    _check(excinfo, "max_delay_s", "a finite number >= 0")


def test_accepts_zero_max_delay_s() -> None:
    assert BatchPolicy(max_delay_s=0).max_delay_s == 0


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf])
def test_rejects_max_batch_cost_that_is_not_positive_and_finite(value: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_batch_cost=value)
    _check(excinfo, "max_batch_cost", "a finite number > 0")


@pytest.mark.parametrize("value", [0, -3, 2.5, False])
def test_rejects_max_queue_size_that_is_not_a_positive_int(value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_queue_size=value)  # type: ignore[arg-type]
    _check(excinfo, "max_queue_size", "an integer >= 1")


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan])
def test_rejects_timeout_s_that_is_not_positive_and_finite(value: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(timeout_s=value)
    _check(excinfo, "timeout_s", "a finite number > 0")


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_rejects_oom_recovery_s_that_is_negative_or_not_finite(value: float) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(oom_recovery_s=value)
    _check(excinfo, "oom_recovery_s", "a finite number >= 0")


@pytest.mark.parametrize("value", [42, "len"])
def test_rejects_cost_fn_that_is_not_callable(value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(cost_fn=value)  # type: ignore[arg-type]
    _check(excinfo, "cost_fn", "a callable")


def test_accepts_callable_cost_fn() -> None:
    assert BatchPolicy(cost_fn=len).cost_fn is len


def test_rejects_preferred_batch_size_above_max_batch_size() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_batch_size=8, preferred_batch_sizes=(4, 16))
    _check(excinfo, "preferred_batch_sizes", "no larger than max_batch_size=8")
    assert excinfo.value.value == (4, 16)


@pytest.mark.parametrize("size", [0, -2, 2.0, True])
def test_rejects_preferred_batch_size_that_is_not_a_positive_int(size: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(max_batch_size=8, preferred_batch_sizes=(4, size))  # type: ignore[arg-type]
    _check(excinfo, "preferred_batch_sizes[]", "an integer >= 1")


def test_sorts_and_deduplicates_preferred_batch_sizes() -> None:
    policy = BatchPolicy(max_batch_size=16, preferred_batch_sizes=(8, 2, 16, 8, 2))
    assert policy.preferred_batch_sizes == (2, 8, 16)


def test_accepts_preferred_batch_sizes_as_a_list() -> None:
    policy = BatchPolicy(max_batch_size=16, preferred_batch_sizes=[4, 2])  # type: ignore[arg-type]
    assert policy.preferred_batch_sizes == (2, 4)


def test_rejects_empty_classes() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(classes=())
    _check(excinfo, "classes", "at least one class")


def test_rejects_duplicate_class_names() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(
            classes=(ClassPolicy("a"), ClassPolicy("b"), ClassPolicy("a")), default_class="a"
        )
    _check(excinfo, "classes", "unique class names")
    assert excinfo.value.value == ["a", "b", "a"]


def test_rejects_default_class_that_is_not_a_class() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(classes=(ClassPolicy("fast"), ClassPolicy("slow")), default_class="medium")
    _check(excinfo, "default_class", "one of ['fast', 'slow']")


def test_default_policy_has_three_classes_with_normal_as_default() -> None:
    policy = BatchPolicy()
    assert [c.name for c in policy.classes] == ["interactive", "normal", "background"]
    assert policy.default_class == DEFAULT_CLASS == "normal"
    assert policy.classes == DEFAULT_CLASSES


# -- ClassPolicy fields ------------------------------------------------------------------


@pytest.mark.parametrize("share", [0, -0.5, 1.01, math.nan, "half", True])
def test_rejects_class_share_outside_zero_to_one(share: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        ClassPolicy("bulk", share=share)  # type: ignore[arg-type]
    _check(excinfo, "classes['bulk'].share", "a number in (0, 1]")


@pytest.mark.parametrize("share", [1e-6, 0.5, 1, 1.0])
def test_accepts_class_share_in_zero_to_one(share: float) -> None:
    assert ClassPolicy("bulk", share=share).share == share


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_batch_size", 0, "an integer >= 1"),
        ("max_batch_size", True, "an integer >= 1"),
        ("max_delay_s", -1.0, "a finite number >= 0"),
        ("max_delay_s", math.nan, "a finite number >= 0"),
        ("max_queue_size", 0, "an integer >= 1"),
        ("timeout_s", 0.0, "a finite number > 0"),
        ("max_wait_s", -0.1, "a finite number >= 0"),
        ("max_wait_s", math.inf, "a finite number >= 0"),
        ("slo_s", 0, "a finite number > 0"),
    ],
)
def test_rejects_invalid_class_field_naming_class_and_field(
    field: str, value: object, expected: str
) -> None:
    with pytest.raises(ConfigError) as excinfo:
        ClassPolicy("gold", **{field: value})  # type: ignore[arg-type]
    _check(excinfo, f"classes['gold'].{field}", expected)


@pytest.mark.parametrize("name", ["", None, 3])
def test_rejects_class_name_that_is_not_a_non_empty_string(name: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        ClassPolicy(name)  # type: ignore[arg-type]
    _check(excinfo, "classes[].name", "a non-empty string")


# -- inheritance: resolved limits ---------------------------------------------------------


def test_class_fields_left_none_inherit_model_wide_values() -> None:
    policy = BatchPolicy(
        max_batch_size=16,
        max_delay_s=0.01,
        timeout_s=2.0,
        classes=(ClassPolicy("a"), ClassPolicy("b", share=0.5, max_wait_s=1.0, slo_s=0.2)),
        default_class="a",
    )
    a, b = policy.limits["a"], policy.limits["b"]
    assert (a.max_batch_size, a.max_delay_s, a.timeout_s) == (16, 0.01, 2.0)
    assert (b.max_batch_size, b.max_delay_s, b.timeout_s) == (16, 0.01, 2.0)
    assert (a.share, a.max_wait_s, a.slo_s, a.max_queue_size) == (1.0, None, None, None)
    assert (b.share, b.max_wait_s, b.slo_s) == (0.5, 1.0, 0.2)


def test_class_fields_that_are_set_override_model_wide_values() -> None:
    policy = BatchPolicy(
        max_batch_size=16,
        max_delay_s=0.01,
        timeout_s=2.0,
        classes=(ClassPolicy("a", max_batch_size=4, max_delay_s=0.0, timeout_s=0.5),),
        default_class="a",
    )
    a = policy.limits["a"]
    assert (a.max_batch_size, a.max_delay_s, a.timeout_s) == (4, 0.0, 0.5)


def test_class_max_batch_size_is_capped_at_model_max_batch_size() -> None:
    policy = BatchPolicy(
        max_batch_size=8, classes=(ClassPolicy("a", max_batch_size=64),), default_class="a"
    )
    assert policy.limits["a"].max_batch_size == 8


def test_class_limits_carry_rank_in_priority_order() -> None:
    policy = BatchPolicy(
        classes=(ClassPolicy("hi"), ClassPolicy("mid"), ClassPolicy("lo")), default_class="mid"
    )
    assert [policy.limits[n].rank for n in ("hi", "mid", "lo")] == [0, 1, 2]
    assert list(policy.limits) == ["hi", "mid", "lo"]


def test_class_limits_of_none_is_the_default_class() -> None:
    policy = BatchPolicy()
    assert policy.class_limits(None) is policy.limits["normal"]
    assert policy.class_limits("background") is policy.limits["background"]


def test_class_limits_of_unknown_class_raises_config_error_listing_classes() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy().class_limits("vip")
    _check(excinfo, "priority", "one of ['interactive', 'normal', 'background']")


# -- replace ------------------------------------------------------------------------------


def test_replace_returns_a_new_policy_with_the_change() -> None:
    policy = BatchPolicy(max_batch_size=8, max_delay_s=0.01)
    changed = policy.replace(max_batch_size=4)
    assert changed.max_batch_size == 4
    assert changed.max_delay_s == 0.01
    assert policy.max_batch_size == 8
    assert changed.limits["normal"].max_batch_size == 4


def test_replace_validates_the_new_values() -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy().replace(max_delay_s=-1.0)
    _check(excinfo, "max_delay_s", "a finite number >= 0")


def test_replace_validates_combinations_against_unchanged_fields() -> None:
    policy = BatchPolicy(max_batch_size=16, preferred_batch_sizes=(8, 16))
    with pytest.raises(ConfigError) as excinfo:
        policy.replace(max_batch_size=8)
    _check(excinfo, "preferred_batch_sizes", "no larger than max_batch_size=8")


@pytest.mark.parametrize("unknown", ["max_batch", "limits"])
def test_replace_rejects_unknown_fields(unknown: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy().replace(**{unknown: 3})
    _check(excinfo, "policy", "fields of BatchPolicy")
    assert excinfo.value.value == [unknown]


def test_policy_is_frozen() -> None:
    policy = BatchPolicy()
    with pytest.raises(AttributeError):
        policy.max_batch_size = 3  # type: ignore[misc]


def test_max_queued_is_the_smaller_of_the_model_and_class_bounds() -> None:
    classes = (ClassPolicy("interactive", max_queue_size=3), ClassPolicy("normal"))
    policy = BatchPolicy(max_queue_size=10, classes=classes, default_class="normal")
    assert policy.max_queued("interactive") == 3
    assert policy.max_queued(None) == policy.max_queued("normal") == 10
    assert policy.max_queued("unknown") == 10  # refused later, at admission
    assert BatchPolicy(classes=(ClassPolicy("normal"),)).max_queued(None) is None


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "60"])
def test_batch_timeout_must_be_a_positive_finite_number_or_none(value: object) -> None:
    with pytest.raises(ConfigError, match="batch_timeout_s") as caught:
        BatchPolicy(batch_timeout_s=value)  # type: ignore[arg-type]
    assert "or None for no limit" in str(caught.value)


def test_batch_timeout_defaults_to_a_minute_and_none_means_no_limit() -> None:
    assert BatchPolicy().batch_timeout_s == 60.0
    assert BatchPolicy(batch_timeout_s=None).batch_timeout_s is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("preferred_batch_sizes", 8),
        ("classes", ("interactive", "normal")),
        ("classes", ClassPolicy("normal")),
    ],
)
def test_malformed_policy_field_raises_config_error_naming_it(field, value):
    """docs/core.md: 'a bad value raises ConfigError naming the field'."""
    with pytest.raises(ConfigError, match=field):
        BatchPolicy(**{field: value})


def test_policy_refuses_length_buckets_that_are_not_a_list() -> None:
    with pytest.raises(ConfigError) as caught:
        BatchPolicy(length_buckets=5)  # type: ignore[arg-type]
    assert caught.value.field == "length_buckets"


@pytest.mark.parametrize("field", ["fill_from_lower", "preempt"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_rejects_a_flag_that_is_not_a_bool(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as excinfo:
        BatchPolicy(**{field: value})  # type: ignore[arg-type]
    _check(excinfo, field, "True or False")
