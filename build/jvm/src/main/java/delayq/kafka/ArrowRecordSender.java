package delayq.kafka;

import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
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
 * Sends a delivery round's records of one topic to Kafka from the driver's JVM, at least once
 * ({@link #send}) or in one transaction with the round's marker ({@link #sendTransaction}). The
 * records come as an Arrow IPC stream (columns {@code key} binary, {@code value} binary,
 * {@code headers} list&lt;struct&lt;key string, value binary&gt;&gt;, as the engine's Python
 * shapes them) written to a file, and go out through this sender's long-lived {@link
 * KafkaProducer}.
 *
 * <p>Spark's Kafka writer did the same through a Spark job per round: the rows shipped to the
 * executors inside the tasks, turned into Spark rows, then into records. Here they are read
 * column by column straight into records. A send returns once every record is acknowledged
 * ({@code acks=all}), or throws the first failure after dropping the producer: the caller then
 * sends the round again with a new one (which, when transactional, first aborts what the old
 * one left open). {@link #send} may be called from several threads at once; {@link
 * #sendTransaction} from one at a time (a producer has one open transaction): the engine gives
 * each topic a sender of its own.
 */
public final class ArrowRecordSender {
  private static final BufferAllocator ALLOCATOR = new RootAllocator();

  private final Map<String, Object> config;
  private KafkaProducer<byte[], byte[]> producer;

  /** A sender with these producer settings (bootstrap.servers, acks, transactional.id, ...). */
  public ArrowRecordSender(Map<String, String> settings) {
    this.config = new HashMap<>(settings);
    this.config.put("key.serializer", ByteArraySerializer.class.getName());
    this.config.put("value.serializer", ByteArraySerializer.class.getName());
  }

  /**
   * Make the producer now, unless made; a transactional one calls {@code initTransactions},
   * which aborts what an earlier producer with its {@code transactional.id} left open and fences
   * that producer.
   */
  public synchronized KafkaProducer<byte[], byte[]> open() {
    if (producer == null) {
      KafkaProducer<byte[], byte[]> made = new KafkaProducer<>(config);
      if (config.containsKey("transactional.id")) {
        try {
          made.initTransactions();
        } catch (RuntimeException e) {
          made.close(Duration.ZERO);
          throw e;
        }
      }
      producer = made;
    }
    return producer;
  }

  /**
   * Send every record of the Arrow stream at {@code path} to {@code topic} and wait for all.
   *
   * @return how many records were sent
   */
  public long send(String topic, String path) throws Exception {
    KafkaProducer<byte[], byte[]> current = open();
    AtomicReference<Exception> failed = new AtomicReference<>();
    long sent;
    try {
      sent = sendAll(current, topic, path, failed);
      current.flush();
      if (failed.get() != null) {
        throw failed.get();
      }
    } catch (Exception | Error e) {
      drop(current);
      throw e;
    }
    return sent;
  }

  /**
   * Send every record of the Arrow stream at {@code path} to {@code topic}, and the marker
   * record ({@code markerKey}, {@code markerValue}) to {@code markerTopic}, in one Kafka
   * transaction: all of them commit together or none does.
   *
   * @return how many records were sent, the marker not counted
   */
  public long sendTransaction(
      String topic, String path, String markerTopic, byte[] markerKey, byte[] markerValue)
      throws Exception {
    KafkaProducer<byte[], byte[]> current = open();
    AtomicReference<Exception> failed = new AtomicReference<>();
    long sent;
    try {
      current.beginTransaction();
      sent = sendAll(current, topic, path, failed);
      current.send(new ProducerRecord<>(markerTopic, markerKey, markerValue));
      current.flush();
      if (failed.get() != null) {
        throw failed.get();
      }
      current.commitTransaction();
    } catch (Exception | Error e) {
      drop(current);  // its open transaction is aborted by the next producer's init
      throw e;
    }
    return sent;
  }

  /** Close the producer (the engine stops). */
  public synchronized void close() {
    if (producer != null) {
      producer.close(Duration.ofSeconds(5));
      producer = null;
    }
  }

  private synchronized void drop(KafkaProducer<byte[], byte[]> failed) {
    if (producer == failed) {
      producer = null;
    }
    try {
      failed.close(Duration.ofSeconds(1));
    } catch (RuntimeException ignored) {
      // fenced or broken: it is dropped either way
    }
  }

  private static long sendAll(
      KafkaProducer<byte[], byte[]> producer,
      String topic,
      String path,
      AtomicReference<Exception> failed)
      throws IOException {
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
                  new String(names.get(j), StandardCharsets.UTF_8),
                  contents.isNull(j) ? null : contents.get(j));
            }
          }
          producer.send(
              new ProducerRecord<>(
                  topic,
                  null,
                  keys.isNull(i) ? null : keys.get(i),
                  values.isNull(i) ? null : values.get(i),
                  recordHeaders),
              (metadata, error) -> {
                if (error != null) {
                  failed.compareAndSet(null, error);
                }
              });
          sent++;
        }
      }
    }
    return sent;
  }
}
