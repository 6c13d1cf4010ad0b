"""CPU XLA flag defaults: added for float32, never overriding a flag the user set."""

from lm.process.cpu_flags import FLOAT32_DEFAULTS, apply_cpu_defaults, with_cpu_defaults

YNN = "--xla_cpu_experimental_ynn_fusion_type"


def test_float32_gets_the_eigen_matmul_path_next_to_user_flags():
    assert FLOAT32_DEFAULTS == (f"{YNN}=",)
    assert with_cpu_defaults("", "float32") == f"{YNN}="
    assert (
        with_cpu_defaults(" --xla_force_host_platform_device_count=8 ", "float32")
        == f"--xla_force_host_platform_device_count=8 {YNN}="
    )


def test_bfloat16_keeps_xla_defaults():
    assert with_cpu_defaults("", "bfloat16") == ""
    assert with_cpu_defaults("--a=1", "bfloat16") == "--a=1"


def test_user_value_wins_and_is_not_duplicated():
    user = f"--xla_dump_to=/tmp/x {YNN}=dot"
    assert with_cpu_defaults(user, "float32") == user
    assert with_cpu_defaults(f"{YNN}", "float32") == YNN
    # A flag that merely starts with the same name is a different flag.
    assert with_cpu_defaults(f"{YNN}_extra=1", "float32") == f"{YNN}_extra=1 {YNN}="


def test_apply_cpu_defaults_edits_the_given_environment():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    apply_cpu_defaults("float32", env)
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {YNN}="
    env = {}
    apply_cpu_defaults("bfloat16", env)
    assert env["XLA_FLAGS"] == ""
