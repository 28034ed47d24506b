# One image for every service process (migrate, worker, beat, flower).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bso ./bso
COPY client ./client
COPY workers ./workers
RUN pip install --no-cache-dir '.[server]'
# Celery refuses to run as root without this; the container is the sandbox.
RUN useradd --create-home bso
USER bso
ENV PYTHONUNBUFFERED=1
