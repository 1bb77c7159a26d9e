import pytest

from tidal_api import JobSpecError, parse_job


def _doc(**spec):
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

