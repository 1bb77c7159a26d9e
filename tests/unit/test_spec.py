"""The job's spec types: defaults, one-line refusals, what is required, bounds, contradictions."""

import pytest

from tidal_api import JobSpecError, parse_job
from tidal_api.spec import MAX_STEPS, MAX_WORKERS

# What every manifest must give: what to train, on how many workers.
REQUIRED = {"workers": {"min": 2, "max": 8}, "model": {"layers": 6, "dModel": 64, "heads": 4}}


def _doc(**spec):
    """A manifest with ``spec``; its ``workers`` and ``model`` fields go over REQUIRED's."""
    for key, value in REQUIRED.items():
        spec[key] = {**value, **spec.get(key, {})}
    return {"apiVersion": "tidal.dev/v1alpha1", "kind": "ElasticTrainingJob",
            "metadata": {"name": "x"}, "spec": spec}


def test_defaults_and_camel_case():
    job = parse_job(_doc(model={"layers": 3, "dModel": 32, "heads": 4, "mtpHeads": 1}))
    assert job.spec.model.d_model == 32
    assert job.spec.model.num_units == 3 + 2 + 1
    assert job.spec.training.num_micro_batches == 8
    assert job.spec.parallelism.consistency == "strict"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": {"layerz": 3}}, "spec.model.layerz: unknown field"),
        ({"workers": {"min": 4, "max": 2}}, "workers.min (4) must not exceed workers.max (2)"),
        ({"model": {"dModel": 30, "heads": 4}}, "model.heads (4) must divide model.dModel (30)"),
        ({"training": {"globalBatchSize": 10, "microBatchSize": 4}}, "must divide"),
        ({"training": {"data": {"kind": "tokens"}}}, "training.data.path is required"),
        ({"parallelism": {"schedule": "fast"}}, "spec.parallelism.schedule"),
    ],
)
def test_bad_input_is_one_clear_line(spec, message):
    with pytest.raises(JobSpecError) as err:
        parse_job(_doc(**spec), "job.yaml")
    text = str(err.value)
    assert message in text
    assert text.startswith("job.yaml: ")
    assert "\n" not in text


@pytest.mark.parametrize("vocab", [128_256, 151_936, 262_144])  # Llama 3, Qwen, Gemma 3
def test_large_tokenizer_vocabularies_are_admitted(vocab):
    assert parse_job(_doc(model={"vocab": vocab})).spec.model.vocab == vocab


def test_not_a_mapping():
    with pytest.raises(JobSpecError, match="expected an ElasticTrainingJob mapping"):
        parse_job(["a"], "j.yaml")


def test_wrong_kind():
    doc = _doc()
    doc["kind"] = "Job"
    with pytest.raises(JobSpecError, match="kind"):
        parse_job(doc)


def test_template_defaults_and_typed_fields():
    template = parse_job(_doc()).spec.template
    assert (template.image, template.image_pull_policy) == ("ghcr.io/tidal-dev/tidal-agent:0.1.0", "IfNotPresent")
    assert template.resources.requests == {} and template.tolerations == ()
    template = parse_job(_doc(template={
        "image": "tidal-agent:0.1.0",
        "resources": {"requests": {"cpu": 8, "memory": "48Gi"}, "limits": {"memory": "48Gi"}},
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    })).spec.template
    assert template.resources.requests == {"cpu": 8, "memory": "48Gi"}
    assert template.node_selector == {"gpu": "h100"}
    assert template.tolerations == ({"key": "nvidia.com/gpu", "operator": "Exists"},)
    assert template.volume_mounts[0]["mountPath"] == "/data"


@pytest.mark.parametrize(
    ("template", "where"),
    [
        ({"command": ["sh"]}, "spec.template.command: unknown field"),
        ({"imagePullPolicy": "Sometimes"}, "spec.template.imagePullPolicy"),
        ({"resources": {"requests": {"cpu": 0.5}}}, "spec.template.resources.requests.cpu"),
        ({"resources": {"claims": []}}, "spec.template.resources.claims: unknown field"),
        ({"labels": {"team": 1}}, "spec.template.labels.team"),
    ],
)
def test_bad_template_is_refused(template, where):
    with pytest.raises(JobSpecError, match=where.replace(".", r"\.")):
        parse_job(_doc(template=template))



@pytest.mark.parametrize(("drop", "message"), [
    ("model", "spec.model: required: the model to train, e.g. model: {layers: 12, dModel: 768, "
              "heads: 12}; Tidal trains no default model"),
    ("workers", "spec.workers: required: the worker pods the job may run with, e.g. workers: "
                "{min: 2, max: 8}"),
])
def test_a_job_without_a_model_or_workers_is_refused_not_trained_as_a_toy(drop, message):
    doc = _doc()
    del doc["spec"][drop]
    with pytest.raises(JobSpecError) as err:
        parse_job(doc, "job.yaml")
    assert str(err.value) == f"job.yaml: {message}"
    doc = _doc()
    doc["spec"] = {}
    with pytest.raises(JobSpecError, match=r"^j: spec.workers: required: .* \(and 1 more\)$"):
        parse_job(doc, "j")
    del doc["spec"]
    with pytest.raises(JobSpecError, match=r"^j: spec: required: what to train"):
        parse_job(doc, "j")


@pytest.mark.parametrize("field", ["layers", "dModel", "heads"])
def test_a_model_gives_its_size(field):
    doc = _doc()
    del doc["spec"]["model"][field]
    with pytest.raises(JobSpecError, match=f"spec.model.{field}: required$"):
        parse_job(doc)


@pytest.mark.parametrize(("spec", "where"), [
    ({"workers": {"max": MAX_WORKERS + 1}}, "spec.workers.max"),
    ({"workers": {"min": MAX_WORKERS + 1, "max": MAX_WORKERS + 1}}, "spec.workers.min"),
    ({"training": {"steps": MAX_STEPS + 1}}, "spec.training.steps"),
    ({"model": {"layers": 1025}}, "spec.model.layers"),
    ({"model": {"dModel": 65536 * 2, "heads": 4}}, "spec.model.dModel"),
    ({"model": {"heads": 2048, "dModel": 4096}}, "spec.model.heads"),
    ({"model": {"seqLen": 2**20 + 1}}, "spec.model.seqLen"),
    ({"training": {"globalBatchSize": 2**20 + 2}}, "spec.training.globalBatchSize"),
    ({"training": {"microBatchSize": 2**16 + 1, "globalBatchSize": 2**17 + 2}},
     "spec.training.microBatchSize"),
])
def test_counts_and_sizes_have_upper_bounds(spec, where):
    with pytest.raises(JobSpecError, match=f"{where}: Input should be less than or equal to"):
        parse_job(_doc(**spec))


def test_the_largest_counts_and_sizes_are_admitted():
    job = parse_job(_doc(workers={"min": 1, "max": MAX_WORKERS}, training={"steps": MAX_STEPS}))
    assert (job.spec.workers.max, job.spec.training.steps) == (4096, 10_000_000)


def test_contradictions_are_reported_in_one_line():
    spec = parse_job(_doc()).spec
    assert spec.contradiction() is None
    wide = spec.model_copy(update={"gpus_per_worker": 2})
    assert "gpusPerWorker is 2" in wide.contradiction()
    too_many = parse_job(_doc(workers={"min": 9, "max": 12})).spec
    assert too_many.contradiction() == (
        "workers.min (9) exceeds the model's 8 placement units (embedding, blocks, head): every "
        "pipeline stage needs at least one")
