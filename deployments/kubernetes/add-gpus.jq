# Adds a `gpus` job variable to Prefect's default Kubernetes base job template and requests that
# many `nvidia.com/gpu` for the flow-run container (see deployments/README.md).
.variables.properties.gpus = {"title": "GPUs", "description": "nvidia.com/gpu limit of the flow-run pod", "type": "integer", "default": 1}
| .job_configuration.job_manifest.spec.template.spec.containers[0].resources = {"limits": {"nvidia.com/gpu": "{{ gpus }}"}, "requests": {"nvidia.com/gpu": "{{ gpus }}"}}
