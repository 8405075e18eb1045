# The rtrl application image (gateway, workers, trainer, migrations). vLLM runs in its own
# image; see docker-compose.yml.
FROM python:3.11-slim
WORKDIR /srv/rtrl
COPY pyproject.toml README.md alembic.ini ./
COPY app app
COPY workers workers
COPY trainer trainer
COPY rtrl rtrl
COPY sandbox sandbox
COPY migrations migrations
RUN pip install --no-cache-dir -e .
ENV RTRL_DATA_DIR=/data
ENTRYPOINT ["rtrl"]
