"""The auto-parallel context: defaults, validation (all or nothing), reset."""
import pytest

import mpicomm
from mpicomm import InvalidArgumentError
from mpicomm.training.context import (get_auto_parallel_context, reset_auto_parallel_context,
                                      set_auto_parallel_context)


@pytest.fixture(autouse=True)
def _fresh():
    reset_auto_parallel_context()
    yield
    reset_auto_parallel_context()


def test_defaults_are_mindsporess():
    assert get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert get_auto_parallel_context("gradients_mean") is False
    assert get_auto_parallel_context("all_reduce_fusion_config") == []
    assert get_auto_parallel_context("parameter_broadcast") is False
    assert get_auto_parallel_context("gradient_fp32_sync") is True


def test_set_get_reset():
    set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True,
                              all_reduce_fusion_config=[20, 35], parameter_broadcast=True,
                              gradient_fp32_sync=False, device_num=8, global_rank=3)
    assert get_auto_parallel_context("parallel_mode") == "data_parallel"
    assert get_auto_parallel_context("gradients_mean") is True
    fc = get_auto_parallel_context("all_reduce_fusion_config")
    assert fc == [20, 35]
    fc.append(99)  # a copy: the context is not changed through it
    assert get_auto_parallel_context("all_reduce_fusion_config") == [20, 35]
    assert get_auto_parallel_context("device_num") == 8
    assert get_auto_parallel_context("global_rank") == 3
    assert get_auto_parallel_context("gradient_fp32_sync") is False
    reset_auto_parallel_context()
    assert get_auto_parallel_context("gradients_mean") is False
    assert get_auto_parallel_context("all_reduce_fusion_config") == []


def test_public_names():
    assert mpicomm.set_auto_parallel_context is set_auto_parallel_context
    assert mpicomm.get_auto_parallel_context is get_auto_parallel_context
    assert mpicomm.reset_auto_parallel_context is reset_auto_parallel_context


@pytest.mark.parametrize("kw, match", [
    (dict(parallel_mode="auto_parallel"), r"parallel_mode='auto_parallel'.*'stand_alone', 'data_parallel'"),
    (dict(gradients_mean=1), r"gradients_mean=1.*True or False"),
    (dict(parameter_broadcast="yes"), r"parameter_broadcast='yes'.*True or False"),
    (dict(gradient_fp32_sync=None), r"gradient_fp32_sync=None.*True or False"),
    (dict(all_reduce_fusion_config=[35, 20]), r"all_reduce_fusion_config=\[35, 20\].*strictly increasing"),
    (dict(all_reduce_fusion_config=[-1]), r"all_reduce_fusion_config=\[-1\]"),
    (dict(device_num=0), r"device_num=0.*an int in 1..4096"),
    (dict(device_num=4097), r"device_num=4097.*an int in 1..4096"),
    (dict(device_num=2.0), r"device_num=2.0.*an int in 1..4096"),
    (dict(global_rank=-1), r"global_rank=-1.*an int in 0..4095"),
    (dict(global_rank=4096), r"global_rank=4096.*an int in 0..4095"),
    (dict(device_num=4, global_rank=4), r"global_rank=4.*below device_num=4 \(0..3\)"),
    (dict(pipeline_stages=2), r"key='pipeline_stages'.*one of all_reduce_fusion_config, device_num, "
                              r"global_rank, gradient_fp32_sync, gradients_mean, parallel_mode, parameter_broadcast"),
])
def test_bad_values_say_what_is_allowed(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        set_auto_parallel_context(**kw)


def test_all_or_nothing():
    with pytest.raises(InvalidArgumentError):
        set_auto_parallel_context(gradients_mean=True, device_num=0)
    assert get_auto_parallel_context("gradients_mean") is False


def test_unknown_key_on_get():
    with pytest.raises(InvalidArgumentError, match=r"key='mode'.*one of all_reduce_fusion_config"):
        get_auto_parallel_context("mode")


def test_device_num_and_rank_unset_without_init():
    if mpicomm.is_initialized():
        pytest.skip("mpicomm is initialised in this process")
    assert get_auto_parallel_context("device_num") == 1
    assert get_auto_parallel_context("global_rank") == 0


@pytest.mark.mpi
def test_device_num_and_rank_unset_follow_the_world(comm):
    reset_auto_parallel_context()
    assert get_auto_parallel_context("device_num") == comm.get_group_size()
    assert get_auto_parallel_context("global_rank") == comm.get_rank()
