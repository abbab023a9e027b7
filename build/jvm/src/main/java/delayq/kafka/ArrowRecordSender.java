package delayq.kafka;

import java.io.FileInputStream;
import java.io.InputStream;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.memory.RootAllocator;
import org.apache.arrow.vector.VarBinaryVector;
import org.apache.arrow.vector.VarCharVector;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.complex.ListVector;
import org.apache.arrow.vector.complex.StructVector;
import org.apache.arrow.vector.ipc.ArrowStreamReader;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * Sends a delivery round's records of one topic to Kafka from the driver's JVM: the records come
 * as an Arrow IPC stream (columns {@code key} binary, {@code value} binary, {@code headers}
 * list&lt;struct&lt;key string, value binary&gt;&gt;, as the engine's Python shapes them) written
 * to a file, and go out through one long-lived idempotent {@link KafkaProducer} per setting.
 *
 * <p>Spark's Kafka writer did the same through a Spark job per round: the rows shipped to the
 * executors inside the tasks, turned into Spark rows, then into records. Here they are read
 * column by column straight into records. {@link #send} returns once every record is
 * acknowledged ({@code acks=all}), or throws the first failure: the caller then sends the round
 * again (at least once; the engine's exactly-once sink is another).
 */
public final class ArrowRecordSender {
  private static final Map<String, KafkaProducer<byte[], byte[]>> PRODUCERS =
      new ConcurrentHashMap<>();
  private static final BufferAllocator ALLOCATOR = new RootAllocator();

  private ArrowRecordSender() {}

  /**
   * Send every record of the Arrow stream at {@code path} to {@code topic} and wait for all.
   *
   * @param settings the producer's settings (bootstrap.servers, acks, batching, timeouts)
   * @return how many records were sent
   */
  public static long send(Map<String, String> settings, String topic, String path)
      throws Exception {
    KafkaProducer<byte[], byte[]> producer = producer(settings);
    AtomicReference<Exception> failed = new AtomicReference<>();
    long sent = 0;
    try (BufferAllocator allocator = ALLOCATOR.newChildAllocator(topic, 0, Long.MAX_VALUE);
        InputStream in = new FileInputStream(path);
        ArrowStreamReader reader = new ArrowStreamReader(in, allocator)) {
      while (reader.loadNextBatch()) {
        VectorSchemaRoot root = reader.getVectorSchemaRoot();
        VarBinaryVector keys = (VarBinaryVector) root.getVector("key");
        VarBinaryVector values = (VarBinaryVector) root.getVector("value");
        ListVector headers = (ListVector) root.getVector("headers");
        StructVector entries = (StructVector) headers.getDataVector();
        VarCharVector names = (VarCharVector) entries.getChild("key");
        VarBinaryVector contents = (VarBinaryVector) entries.getChild("value");
        int rows = root.getRowCount();
        for (int i = 0; i < rows; i++) {
          RecordHeaders recordHeaders = new RecordHeaders();
          if (!headers.isNull(i)) {
            int end = headers.getElementEndIndex(i);
            for (int j = headers.getElementStartIndex(i); j < end; j++) {
              recordHeaders.add(
                  new String(names.get(j), java.nio.charset.StandardCharsets.UTF_8),
                  contents.isNull(j) ? null : contents.get(j));
            }
          }
          ProducerRecord<byte[], byte[]> record =
              new ProducerRecord<>(
                  topic,
                  null,
                  keys.isNull(i) ? null : keys.get(i),
                  values.isNull(i) ? null : values.get(i),
                  recordHeaders);
          producer.send(
              record,
              (metadata, error) -> {
                if (error != null) {
                  failed.compareAndSet(null, error);
                }
              });
          sent++;
        }
      }
    }
    producer.flush();
    Exception error = failed.get();
    if (error != null) {
      forget(settings, producer);  // a new producer for the round's next try
      throw error;
    }
    return sent;
  }

  /** Close every producer (the engine stops). */
  public static void closeAll() {
    for (KafkaProducer<byte[], byte[]> producer : PRODUCERS.values()) {
      producer.close(java.time.Duration.ofSeconds(5));
    }
    PRODUCERS.clear();
  }

  private static KafkaProducer<byte[], byte[]> producer(Map<String, String> settings) {
    return PRODUCERS.computeIfAbsent(
        key(settings),
        k -> {
          Map<String, Object> config = new HashMap<>(settings);
          config.put("key.serializer", ByteArraySerializer.class.getName());
          config.put("value.serializer", ByteArraySerializer.class.getName());
          return new KafkaProducer<>(config);
        });
  }

  private static void forget(Map<String, String> settings, KafkaProducer<byte[], byte[]> producer) {
    if (PRODUCERS.remove(key(settings), producer)) {
      producer.close(java.time.Duration.ofSeconds(1));
    }
  }

  private static String key(Map<String, String> settings) {
    return new java.util.TreeMap<>(settings).toString();
  }
}
