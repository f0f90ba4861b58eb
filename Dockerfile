# One image for every Magnitude service; compose picks the process with `command:` (docs/containers.md).
# It builds with BuildKit and with the classic builder (Debian's docker.io, a docker CLI without buildx),
# so it uses no RUN --mount and no stage that only BuildKit would skip.
#
# Where llama-cpp-python and the other Python packages come from: --build-arg INSTALL_FROM=
#   auto        (default) the wheelhouse when it holds a llama-cpp-python wheel, else compile
#   wheelhouse  offline: pip --no-index from ./wheelhouse (made by `bash scripts/provision/wheelhouse` where PyPI
#               answers); `docker build --network none` proves nothing else is fetched
#   compile     a box with internet: compile llama-cpp-python for the CPU that builds the image
#               (native/build_llama_wheel.sh) and take the other packages from PyPI
# The base: a stock debian:bookworm-slim, or what `scripts/provision/base_image` built from Debian packages under
# that name where no container registry answers (it already holds docker/os-packages.txt).
# Models are not in the image: the compose setup jobs assemble them into the `models` volume.
ARG BASE_IMAGE=debian:bookworm-slim

# --- stage 1: the virtualenv (/opt/magnitude) with llama-cpp-python, the dependencies and the project
FROM ${BASE_IMAGE} AS venv
WORKDIR /src
COPY docker/os-packages.txt docker/install-os-packages docker/
RUN docker/install-os-packages
COPY docker/build-venv docker/requirements.py docker/
COPY native native
COPY wheelhouse wheelhouse
COPY pyproject.toml README.md ./
ARG INSTALL_FROM=auto
RUN docker/build-venv dependencies "$INSTALL_FROM"
COPY shared shared
COPY services services
COPY magnitude magnitude
RUN docker/build-venv project "$INSTALL_FROM"

# --- stage 2: the runtime, as the non-root user magnitude (uid 10001)
FROM ${BASE_IMAGE}
COPY docker/os-packages.txt docker/install-os-packages /app/docker/
RUN /app/docker/install-os-packages \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/magnitude --shell /usr/sbin/nologin magnitude \
    && install -d -o magnitude -g magnitude -m 0750 /run/magnitude /var/lib/magnitude \
       /var/lib/magnitude/models /var/lib/magnitude/data
COPY --from=venv /opt/magnitude /opt/magnitude
WORKDIR /app
COPY scripts scripts
COPY docker docker
COPY docker/magnitude.yaml /etc/magnitude/magnitude.yaml
ENV PATH=/opt/magnitude/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    MAGNITUDE_HOME=/var/lib/magnitude \
    MAGNITUDE_CONFIG=/etc/magnitude/magnitude.yaml \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER magnitude
ENTRYPOINT ["/app/docker/entrypoint"]
CMD ["magnitude", "--help"]
