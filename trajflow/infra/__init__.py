"""Infrastructure code: devices, Ray placement and the local Ray cluster, worker environment, deployments.

It mirrors the top-level ``infra/`` folder (the files Prefect, Ray and Docker read); see
``infra/README.md`` for which module reads which file.
"""
