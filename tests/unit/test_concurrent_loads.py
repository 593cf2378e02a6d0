"""Model loads in several threads at once (a test's server thread beside the next test, or two replicas' warm-ups
in one process) must not break later loads: transformers swaps PreTrainedModel.tie_weights for a no-op while it
loads, and interleaved loads left the no-op in place, so every later tied model (an MLM head, a tied LM head)
loaded with its tied weights on the meta device. Seen in CI as "Cannot copy out of meta tensor"."""
import threading

from transformers import PreTrainedModel

from models.adapters.bert import BertAdapter
_TIE_WEIGHTS = PreTrainedModel.tie_weights


def test_loads_in_many_threads_leave_weight_tying_intact(tiny_bert, tiny_mlm):
    errors: list[BaseException] = []

    def load(folder, name):
        try:
            for _ in range(3):
                BertAdapter(name, str(folder), max_tokens=16, device="cpu")
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(tiny_bert if i % 2 else tiny_mlm, f"m{i}")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    assert PreTrainedModel.tie_weights is _TIE_WEIGHTS
    mlm = BertAdapter("after", str(tiny_mlm), max_tokens=16, device="cpu").model
    decoder, embeddings = mlm.cls.predictions.decoder.weight, mlm.bert.embeddings.word_embeddings.weight
    assert decoder.device.type == "cpu" and decoder.data_ptr() == embeddings.data_ptr()  # tied, not on meta
