# The controller image the rendered Deployment names (rayscale render --image, default rayscale:0.1.0).
# The controller plans and acts; it serves no model, so it needs no vLLM build: the core, [kube] for the
# Karpenter/KubeRay path and [aws] for `rayscale prices`. Its Ray client must match the cluster's Ray.
FROM python:3.11-slim
WORKDIR /opt/rayscale
COPY pyproject.toml README.md ./
COPY rayscale ./rayscale
RUN pip install --no-cache-dir ".[kube,aws]" && useradd --uid 1000 --create-home rayscale
USER 1000
ENTRYPOINT ["rayscale"]
CMD ["controller", "--help"]
