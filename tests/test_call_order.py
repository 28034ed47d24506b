"""Zeus's call order, enforced by the optimizer (bso_client.call_order)."""

from __future__ import annotations

import pytest

from bso.errors import OutOfOrder
from bso_client.errors import OperationOrderError
from tests.test_optimizer import RecordingService, make


@pytest.mark.parametrize("step", range(4))
def test_calls_out_of_order_raise_operation_order_error(step: int) -> None:
    bso = make(RecordingService())
    if step == 0:
        with pytest.raises(OperationOrderError, match="after get_batch_size"):
            bso.on_train_begin()
    elif step == 1:
        bso.get_batch_size()
        with pytest.raises(OperationOrderError, match="after on_train_begin"):
            bso.on_evaluate(0.1)
    elif step == 2:
        bso.get_batch_size()
        bso.on_train_begin()
        with pytest.raises(OutOfOrder):  # the service's error type catches it too
            bso.on_train_begin()
    else:
        bso.get_batch_size()
        bso.on_train_begin()
        bso.on_evaluate(0.99)
        with pytest.raises(OperationOrderError, match="stopped by the service"):
            bso.on_evaluate(0.99)
    bso.close()
    with pytest.raises(OperationOrderError, match="after the trial ended"):
        bso.on_train_begin()
