# An image for `psworker k8s manifest --image ...`: psworker and TensorFlow (CPU) on Python 3.11.
#   docker build -t REGISTRY/psworker:0.1.0 . && docker push REGISTRY/psworker:0.1.0
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY setup.cfg pyproject.toml README.md ./
COPY psworker ./psworker
RUN pip install . && rm -rf /src

# Tasks run unprivileged; the manifests mount the train dir (owned by this uid's group via fsGroup if needed).
RUN useradd --create-home --uid 1000 psworker
USER 1000
WORKDIR /home/psworker
# The manifests give the whole argv (`psworker ps`, `psworker worker --flag ...`); this is only a default.
CMD ["psworker", "--help"]
