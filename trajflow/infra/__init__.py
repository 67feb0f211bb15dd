"""Infrastructure code: devices, Ray placement, the Ray cluster, process environments, deployments.

It mirrors the top-level ``infra/`` folder (the files Prefect, Ray and Docker read); see
``infra/README.md`` for which module reads which file.
"""
