# One image for every service process of compose.yaml (migrate, worker, beat, flower).
# It holds bso with its server extra only: no client, plot or dev extra, so no
# torch.  The first stage installs it into a virtualenv; the second copies that
# virtualenv alone, without the source tree, pip, setuptools or any pip cache.
# No secret is baked in: compose hands every password to the containers through
# their environment at run time (.env, written by scripts/compose_env.py, is
# never in the build context: see .dockerignore).
# Size estimate and how it was made: docs/security.md, "compose.yaml".

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bso ./bso
COPY client ./client
COPY workers ./workers
RUN python -m venv /opt/bso \
    && /opt/bso/bin/pip install --no-cache-dir '.[server]' \
    && /opt/bso/bin/pip uninstall --yes pip setuptools

FROM python:3.11-slim
# Same base as the build stage: the virtualenv's python links to its interpreter.
COPY --from=build /opt/bso /opt/bso
ENV PATH=/opt/bso/bin:$PATH PYTHONUNBUFFERED=1
# Not root (Celery also refuses to run as root without a flag); a fixed uid, so
# that an orchestrator's runAsNonRoot check can verify it.  The code in /opt/bso
# stays owned by root, so the service cannot rewrite it.
RUN useradd --create-home --uid 10001 --user-group bso \
    && mkdir -p /var/lib/bso-metrics && chown 10001:10001 /var/lib/bso-metrics
# /var/lib/bso-metrics: the workers' Prometheus files (compose mounts the shared
# metrics-data volume there; a fresh volume takes this folder's owner).
USER 10001:10001
WORKDIR /home/bso
